//! What the integration tests share: a small random model written once per test binary.

use std::path::PathBuf;

use detspec::demo::{write_demo_model, DemoModelSpec};

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
