//! What the integration tests share: a small random model written once per test binary.

use std::path::PathBuf;

use detspec::demo::{write_demo_model, DemoModelSpec};
use detspec::RequestOutput;

/// The tests' model: 2 layers, hidden 64, GQA 4/2, vocab 512 (tokenizer 400). `init_std`
/// sets how flat its next-token distributions are (small: near-ties are common, so batch
/// variance shows); `tag` keeps test binaries running in parallel out of each other's way. It
/// is written under cargo's scratch directory for integration tests (`target/tmp`), not the
/// system's temporary directory, which the tests would otherwise fill run after run.
pub fn write_test_model(
    tag: &str,
    seed: u64,
    init_std: f32,
    max_position_embeddings: usize,
) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("detspec-{tag}-test-{}", std::process::id()));
    let spec = DemoModelSpec {
        hidden_size: 64,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        intermediate_size: 128,
        vocab_size: 512,
        tokenizer_vocab_size: 400,
        max_position_embeddings,
        seed,
        init_std,
    };
    write_demo_model(&dir, &spec).expect("write the test model");
    dir
}

/// A xorshift generator: the tests' random prompts, batches and arrivals, the same on every
/// machine.
#[allow(dead_code)] // not every test binary draws
pub struct Rng(pub u64);

#[allow(dead_code)]
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// `len` token ids below the test tokenizer's 400.
    pub fn prompt(&mut self, len: usize) -> Vec<u32> {
        (0..len).map(|_| self.below(400) as u32).collect()
    }
}

/// The first completion's token ids and the f32 bits of their logprobs.
#[allow(dead_code)]
pub type Bits = (Vec<u32>, Vec<u32>);

#[allow(dead_code)]
pub fn bits(o: &RequestOutput) -> Bits {
    let c = &o.outputs[0];
    (
        c.token_ids.clone(),
        c.logprobs.iter().map(|l| l.logprob.to_bits()).collect(),
    )
}
