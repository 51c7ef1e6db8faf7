//! Random-weight Llama models (and Mixtral-style mixtures of experts) built locally, for the
//! built-in default model, the benchmark model (docs/architecture.md, "Benchmark model") and
//! tests. Nothing is downloaded: weights
//! come from a seeded generator and the tokenizer is a byte-level BPE trained on an embedded
//! corpus.

use crate::sampling::rng::{mix64, SPLITMIX_GAMMA};
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    TokenizerImpl,
};

use crate::error::{DetspecError, Result};

/// Shape and seed of a generated Llama model.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoModelSpec {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub intermediate_size: usize,
    /// Model vocabulary; at least the tokenizer's (extra rows are never produced by it).
    pub vocab_size: usize,
    /// Merges the BPE tokenizer learns up to (capped by the corpus).
    pub tokenizer_vocab_size: usize,
    pub max_position_embeddings: usize,
    pub seed: u64,
    /// Standard deviation of the random weights; larger gives peakier next-token distributions.
    pub init_std: f32,
    /// A Mixtral-style sparse MLP in every layer instead of the dense one, each expert
    /// `intermediate_size` wide.
    pub moe: Option<DemoMoe>,
}

/// The experts of a generated mixture-of-experts model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DemoMoe {
    pub num_experts: usize,
    /// Experts each token runs.
    pub top_k: usize,
}

impl DemoModelSpec {
    /// The built-in default model: tiny, loads and generates in well under a second.
    pub fn tiny() -> Self {
        Self {
            hidden_size: 128,
            num_layers: 4,
            num_heads: 4,
            num_kv_heads: 2,
            intermediate_size: 344,
            vocab_size: 1024,
            tokenizer_vocab_size: 1024,
            max_position_embeddings: 2048,
            seed: 0,
            init_std: 0.08,
            moe: None,
        }
    }

    /// [`Self::tiny`] with 8 experts, 2 per token, each half the dense MLP's width.
    pub fn tiny_moe() -> Self {
        Self {
            intermediate_size: 172,
            moe: Some(DemoMoe {
                num_experts: 8,
                top_k: 2,
            }),
            ..Self::tiny()
        }
    }

    /// The benchmark model (~56 M parameters; docs/architecture.md, "Benchmark model").
    pub fn bench() -> Self {
        Self {
            hidden_size: 512,
            num_layers: 8,
            num_heads: 8,
            num_kv_heads: 4,
            intermediate_size: 1408,
            vocab_size: 32000,
            tokenizer_vocab_size: 4096,
            max_position_embeddings: 4096,
            seed: 0,
            init_std: 0.05,
            moe: None,
        }
    }

    /// The benchmark model's mixture-of-experts twin: 32 experts a layer, 4 per token, each a
    /// quarter of the dense MLP's width, so a token computes what the benchmark model does
    /// (same attention, same active MLP size) from 8× its MLP weights (~177 M parameters).
    pub fn bench_moe() -> Self {
        Self {
            intermediate_size: 352,
            moe: Some(DemoMoe {
                num_experts: 32,
                top_k: 4,
            }),
            ..Self::bench()
        }
    }
}

const CORPUS: &str = "Deterministic inference means that the same prompt, the same sampling \
parameters and the same seed give the same tokens and the same log probabilities, bit for bit, \
whatever else the server is doing. Dynamic batching changes the shapes of matrix products and \
the order of floating point reductions, so a request can see different numbers depending on its \
neighbours. Decode verify rollback keeps the fast path for everyone and replays the tokens of a \
deterministic request through a verifier whose reduction schedule never depends on the batch. \
The verifier commits the tokens it agrees with and rolls the cache back past the first \
mismatch. The quick brown fox jumps over the lazy dog. Hello world! What is the capital of \
France? Paris is the capital of France, Berlin of Germany, Rome of Italy and Madrid of Spain. \
Once upon a time there was a small model that wanted to tell stories about numbers, caches, \
pages, tokens, kernels, threads and schedulers. It learned to count: one two three four five six \
seven eight nine ten eleven twelve. Evaluations, reinforcement learning rollouts, debugging and \
audits all need outputs that can be reproduced later.";

/// Trains the byte-level BPE tokenizer of the demo models and returns its `tokenizer.json`.
pub fn demo_tokenizer_json(vocab_size: usize) -> Result<String> {
    let err =
        |e: tokenizers::Error| DetspecError::Tokenizer(format!("training the demo tokenizer: {e}"));
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(1)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![
            AddedToken::from("<s>", true),
            AddedToken::from("</s>", true),
        ])
        .build();
    let mut tk: TokenizerImpl<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerImpl::new(BPE::default());
    tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tk.with_decoder(Some(ByteLevel::default()));
    let lines: Vec<String> = CORPUS.split(". ").map(str::to_string).collect();
    tk.train(&mut trainer, lines.into_iter()).map_err(err)?;
    tokenizers::Tokenizer::from(tk)
        .to_string(false)
        .map_err(err)
}

/// SplitMix64 stream turned into standard normals (Box–Muller); seeded, platform-independent.
struct Normal(u64);

impl Normal {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(SPLITMIX_GAMMA);
        mix64(self.0)
    }

    fn sample(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// Writes `config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json` and
/// `tokenizer_config.json` for `spec` into `dir` (created if needed).
pub fn write_demo_model(dir: &Path, spec: &DemoModelSpec) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| DetspecError::io(dir, e))?;
    let tokenizer = demo_tokenizer_json(spec.tokenizer_vocab_size)?;
    let tok = tokenizers::Tokenizer::from_bytes(tokenizer.as_bytes())
        .map_err(|e| DetspecError::Tokenizer(format!("reloading the demo tokenizer: {e}")))?;
    let (bos, eos) = (
        tok.token_to_id("<s>").unwrap_or(0),
        tok.token_to_id("</s>").unwrap_or(1),
    );
    if tok.get_vocab_size(true) > spec.vocab_size {
        return Err(DetspecError::param(
            "vocab_size",
            format!(
                "{} is smaller than the tokenizer's {}",
                spec.vocab_size,
                tok.get_vocab_size(true)
            ),
        ));
    }
    let head_dim = spec.hidden_size / spec.num_heads;
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    });
    if let (Some(moe), Some(c)) = (spec.moe, config.as_object_mut()) {
        c.insert(
            "architectures".into(),
            serde_json::json!(["MixtralForCausalLM"]),
        );
        c.insert("model_type".into(), "mixtral".into());
        c.insert("num_local_experts".into(), moe.num_experts.into());
        c.insert("num_experts_per_tok".into(), moe.top_k.into());
        c.insert("sliding_window".into(), serde_json::Value::Null);
    }
    let files = [
        ("config.json", serde_json::to_string_pretty(&config).unwrap_or_default()),
        (
            "generation_config.json",
            serde_json::json!({"bos_token_id": bos, "eos_token_id": eos}).to_string(),
        ),
        ("tokenizer.json", tokenizer),
        (
            "tokenizer_config.json",
            serde_json::json!({
                "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": false,
                "chat_template": "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] | trim }}</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
            })
            .to_string(),
        ),
    ];
    for (name, text) in files {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| DetspecError::io(&p, e))?;
    }
    let p = dir.join("model.safetensors");
    std::fs::write(&p, demo_weights(spec)?).map_err(|e| DetspecError::io(&p, e))
}

/// Serialized safetensors bytes of a random Llama with `spec`'s shape.
fn demo_weights(spec: &DemoModelSpec) -> Result<Vec<u8>> {
    let (h, i, v) = (spec.hidden_size, spec.intermediate_size, spec.vocab_size);
    let hd = h / spec.num_heads;
    let kv = spec.num_kv_heads * hd;
    let mut shapes: Vec<(String, Vec<usize>, bool)> =
        vec![("model.embed_tokens.weight".into(), vec![v, h], false)];
    for l in 0..spec.num_layers {
        let p = format!("model.layers.{l}");
        shapes.extend([
            (format!("{p}.input_layernorm.weight"), vec![h], true),
            (format!("{p}.self_attn.q_proj.weight"), vec![h, h], false),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, h], false),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, h], false),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, h], false),
            (
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                true,
            ),
        ]);
        match spec.moe {
            None => shapes.extend([
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h], false),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h], false),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i], false),
            ]),
            Some(moe) => {
                let m = format!("{p}.block_sparse_moe");
                shapes.push((format!("{m}.gate.weight"), vec![moe.num_experts, h], false));
                for e in 0..moe.num_experts {
                    shapes.extend([
                        (format!("{m}.experts.{e}.w1.weight"), vec![i, h], false),
                        (format!("{m}.experts.{e}.w2.weight"), vec![h, i], false),
                        (format!("{m}.experts.{e}.w3.weight"), vec![i, h], false),
                    ]);
                }
            }
        }
    }
    shapes.push(("model.norm.weight".into(), vec![h], true));
    shapes.push(("lm_head.weight".into(), vec![v, h], false));

    let mut rng = Normal(spec.seed);
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .map(|(_, shape, is_norm)| {
            let n: usize = shape.iter().product();
            (0..n)
                .flat_map(|_| {
                    let x = rng.sample() * spec.init_std;
                    let w = if *is_norm { 1.0 + x } else { x };
                    w.to_le_bytes()
                })
                .collect()
        })
        .collect();
    let views = shapes
        .iter()
        .zip(&data)
        .map(|((name, shape, _), bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|t| (name.clone(), t))
                .map_err(|e| DetspecError::param("demo_model", format!("tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, None)
        .map_err(|e| DetspecError::param("demo_model", format!("serialize: {e}")))
}
