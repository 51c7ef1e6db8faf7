//! What the integration tests share: a small random model written once per test binary.

use std::path::PathBuf;
use std::time::Duration;

use detspec::demo::{write_demo_model, DemoModelSpec, DemoMoe};
use detspec::{Engine, Request, RequestOutput, SamplingParams};

/// The tests' model: 2 layers, hidden 64, GQA 4/2, vocab 512 (tokenizer 400). `init_std`
/// sets how flat its next-token distributions are (small: near-ties are common, so batch
/// variance shows); `tag` keeps test binaries running in parallel out of each other's way. It
/// is written under cargo's scratch directory for integration tests (`target/tmp`), not the
/// system's temporary directory, which the tests would otherwise fill run after run.
#[allow(dead_code)] // the MoE tests write their own
pub fn write_test_model(
    tag: &str,
    seed: u64,
    init_std: f32,
    max_position_embeddings: usize,
) -> PathBuf {
    write_test_model_with(tag, seed, init_std, max_position_embeddings, None)
}

/// [`write_test_model`], with `moe`: a Mixtral-style mixture of experts in every layer (each
/// expert 64 wide).
#[allow(dead_code)] // not every test binary runs a mixture of experts
pub fn write_test_model_with(
    tag: &str,
    seed: u64,
    init_std: f32,
    max_position_embeddings: usize,
    moe: Option<DemoMoe>,
) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("detspec-{tag}-test-{}", std::process::id()));
    let spec = DemoModelSpec {
        hidden_size: 64,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        intermediate_size: if moe.is_some() { 64 } else { 128 },
        vocab_size: 512,
        tokenizer_vocab_size: 400,
        max_position_embeddings,
        seed,
        init_std,
        moe,
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

/// Runs `target` at a random position in a random batch with random arrivals; returns its bits.
#[allow(dead_code)]
pub fn in_haystack(e: &Engine, target: &Request, seed: u64, det_neighbours: bool) -> Bits {
    let mut rng = Rng(seed.wrapping_mul(0x9e3779b97f4a7c15) | 1);
    let others = 1 + rng.below(32) as usize;
    let position = rng.below(others as u64 + 1) as usize;
    let mut streams = Vec::new();
    let mut target_stream = None;
    for i in 0..=others {
        if i == position {
            target_stream = Some(e.add_request(target.clone()).unwrap());
            continue;
        }
        let params = SamplingParams {
            temperature: if rng.below(2) == 0 { 0.0 } else { 1.0 },
            seed: Some(rng.next()),
            max_tokens: 1 + rng.below(60) as usize,
            ignore_eos: true,
            deterministic: det_neighbours && rng.below(2) == 0,
            ..Default::default()
        };
        let len = 1 + rng.below(120) as usize;
        streams.push(
            e.add_request(Request::new(
                format!("o{seed}-{i}"),
                rng.prompt(len),
                params,
            ))
            .unwrap(),
        );
        // Random arrival: sometimes let the engine run a little before the next request.
        if rng.below(3) == 0 {
            std::thread::sleep(Duration::from_millis(rng.below(4)));
        }
    }
    let out = target_stream.unwrap().wait().unwrap();
    for s in streams {
        s.wait().unwrap();
    }
    bits(&out)
}
