//! LoRA adapters: PEFT's `adapter_config.json` + `adapter_model.safetensors`, applied per
//! request on top of the base model (vLLM's multi-LoRA serving).
//!
//! A targeted linear layer computes `x W^T + ((x A^T) B^T) · s`, `s` = `lora_alpha / r`
//! (`/ √r` with `use_rslora`), as PEFT does; `s` is folded into `B` at load. Rows of different
//! adapters (and rows of none) share a forward: the base GEMM runs over every row, and each
//! adapter's two small GEMMs over its own rows, on the invariant kernels (the CPU's packed
//! fixed-order GEMM, fixed row blocks elsewhere), added to the base output row by row. The
//! layers that read one input (q/k/v, gate/up) share one such GEMM pair ([`LoraPair`]). A row's
//! delta is so a function of that row alone, and the sum is one rounding per element: an
//! adapter keeps the determinism contract of the base model, whatever else shares the batch.
//!
//! An adapter is immutable once loaded and shared by `Arc`: a request holds the adapter it
//! started with until it ends, so unloading or replacing one by name never changes a running
//! request. Its content hash names it in the request's fingerprint and keeps its KV pages
//! apart from the base model's in the prefix cache.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use safetensors::{Dtype as StDtype, SafeTensors};
use xxhash_rust::xxh3::Xxh3;

use crate::config::{Architecture, KernelProfile, ModelConfig};
use crate::error::{DetspecError, Result};

use super::linear::{GemmOptions, LinearWeight};
use super::weights::is_vision_name;

/// The linear layers of a decoder layer an adapter may target, in the order the decoder runs
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraTarget {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl LoraTarget {
    const ALL: [LoraTarget; 7] = [
        Self::Q,
        Self::K,
        Self::V,
        Self::O,
        Self::Gate,
        Self::Up,
        Self::Down,
    ];

    /// The targets that read one input, in the decoder's order: q/k/v (the attention's input),
    /// o, gate/up (the MLP's input), down. An adapter's pairs of one group run as one GEMM pair.
    const GROUPS: [&'static [LoraTarget]; 4] = [
        &[Self::Q, Self::K, Self::V],
        &[Self::O],
        &[Self::Gate, Self::Up],
        &[Self::Down],
    ];

    /// The module path inside a layer, as `arch`'s checkpoints name it apart.
    fn module(self, arch: Architecture) -> &'static str {
        let fused = arch.fused();
        let [gate, up] = fused.gate_and_up_modules();
        match self {
            Self::Q => "self_attn.q_proj",
            Self::K => "self_attn.k_proj",
            Self::V => "self_attn.v_proj",
            Self::O => arch.o_proj_module(),
            Self::Gate => gate,
            Self::Up => up,
            Self::Down => fused.down_module(),
        }
    }

    /// The targets the checkpoint module `module` (`self_attn.q_proj`) holds: one, or on a
    /// model that stores them fused (Phi-3: both; GLM: gate/up), q/k/v as
    /// `self_attn.qkv_proj` and gate/up as `mlp.gate_up_proj`, each then under that name only;
    /// Granite 4's MLP under its own names (`shared_mlp.input_linear`, `.output_linear`),
    /// LFM2's (`self_attn.out_proj`, `feed_forward.w1`/`w3`/`w2`).
    fn of_module(module: &str, arch: Architecture) -> Option<&'static [LoraTarget]> {
        let fused = arch.fused();
        match module {
            "self_attn.qkv_proj" => fused.qkv.then_some(Self::GROUPS[0]),
            m if fused.gate_up && m == fused.gate_up_module() => Some(Self::GROUPS[2]),
            m if m == fused.down_module() => Some(Self::GROUPS[3]),
            _ => {
                let i = Self::ALL.iter().position(|t| t.module(arch) == module)?;
                let target = &Self::ALL[i..=i];
                let in_fused = match target[0] {
                    Self::Q | Self::K | Self::V => fused.qkv,
                    Self::Gate | Self::Up => fused.gate_up,
                    Self::O => false,
                    // (the model's down module matched above)
                    Self::Down => true,
                };
                (!in_fused).then_some(target)
            }
        }
    }

    /// `(in, out)` of the base layer.
    fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let (hs, is) = (cfg.hidden_size, cfg.intermediate_size);
        // q_proj's output holds each head's output gate too, where the model has one.
        let [q_out, kv, _] = cfg.qkv_widths();
        let q = cfg.num_attention_heads * cfg.head_dim;
        match self {
            Self::Q => (hs, q_out),
            Self::K | Self::V => (hs, kv),
            Self::O => (q, hs),
            Self::Gate | Self::Up => (hs, is),
            Self::Down => (is, hs),
        }
    }
}

/// The low-rank pairs of one layer's targets that read the same input (a [`LoraTarget::GROUPS`]
/// entry), as one GEMM pair held as the device's GEMM wants it: the targeted `lora_A`s stacked
/// (`[Σr, in]`) and the `lora_B · s` block-diagonal (`[Σout, Σr]`, over every target of the
/// group: a target the adapter leaves alone has zero rows). Two GEMMs then give the deltas of
/// q/k/v (or gate/up) side by side in the group's order, where a pair per target took six
/// calls, each with its own fixed cost (on a GPU, launches: most of an adapter's cost there).
///
/// On the CPU a delta element is the FMA chain of its own pair with exact zero products added
/// (the fixed-order GEMM runs each element's chain along `k`), so it has the per-target value
/// (a `-0` may come out `+0`; an infinite intermediate, already a broken delta, spreads to the
/// group's other targets as NaN). On other devices the library's schedule may depend on `K`,
/// so the bits are those of this shape; either way the GEMMs run on the invariant kernels and
/// a row's delta is a function of that row alone.
#[derive(Debug)]
struct LoraPair {
    /// `[Σr, in]`: `x → x A^T` for every targeted layer of the group.
    down: LinearWeight,
    /// `[Σout, Σr]`, block-diagonal.
    up: LinearWeight,
}

/// `(lora_A, lora_B)` of one layer as read so far.
type HalfPair = (Option<Tensor>, Option<Tensor>);

/// A loaded LoRA adapter.
#[derive(Debug)]
pub struct LoraAdapter {
    dir: PathBuf,
    rank: usize,
    /// Per decoder layer, per [`LoraTarget::GROUPS`] entry: the group's pair, where the adapter
    /// targets any of its layers.
    layers: Vec<[Option<LoraPair>; 4]>,
    /// Content hash of the scaled pairs (xxh3 over names and f32 values).
    hash: u64,
}

/// The PEFT config fields detspec reads; the others that would change the forward are refused.
#[derive(Debug, serde::Deserialize)]
struct AdapterConfig {
    #[serde(default)]
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    modules_to_save: Option<serde_json::Value>,
    #[serde(default)]
    alpha_pattern: Option<serde_json::Map<String, serde_json::Value>>,
}

/// What an adapter is loaded for: the base model's config, where its activations live and in
/// what dtype, and the largest rank accepted.
#[derive(Debug, Clone, Copy)]
pub struct LoraBase<'a> {
    pub config: &'a ModelConfig,
    pub device: &'a Device,
    pub dtype: DType,
    pub max_rank: usize,
}

impl LoraAdapter {
    /// Loads the PEFT adapter in `dir` (`adapter_config.json`, `adapter_model.safetensors`).
    pub fn load(dir: &Path, base: &LoraBase<'_>) -> Result<Self> {
        let config_path = dir.join("adapter_config.json");
        let text =
            std::fs::read_to_string(&config_path).map_err(|e| DetspecError::io(&config_path, e))?;
        // The config first: an adapter refused for what it is is not read any further.
        let config = parse_config(&text, &config_path, base.max_rank)?;
        let weights_path = dir.join("adapter_model.safetensors");
        let bytes = std::fs::read(&weights_path).map_err(|e| DetspecError::io(&weights_path, e))?;
        let mut adapter = Self::from_parts(&config, (&bytes, &weights_path), base)?;
        adapter.dir = dir.to_path_buf();
        Ok(adapter)
    }

    /// An adapter from its config's JSON text and the bytes of its safetensors file (an RL
    /// trainer's adapter sent without a file); errors name `label`.
    pub fn from_bytes(
        label: &Path,
        config_json: &str,
        safetensors: &[u8],
        base: &LoraBase<'_>,
    ) -> Result<Self> {
        let config = parse_config(config_json, label, base.max_rank)?;
        Self::from_parts(&config, (safetensors, label), base)
    }

    /// The adapter of a checked config and its weights (bytes, the path errors name).
    fn from_parts(
        config: &AdapterConfig,
        (bytes, weights_path): (&[u8], &Path),
        base: &LoraBase<'_>,
    ) -> Result<Self> {
        let (cfg, device, dtype, max_rank) = (base.config, base.device, base.dtype, base.max_rank);
        if cfg.mla.is_some() {
            return Err(DetspecError::InvalidConfig {
                path: weights_path.to_path_buf(),
                field: "target_modules".into(),
                message: "LoRA adapters are not supported on latent-attention models \
                          (DeepSeek-V3): their attention has no q/k/v projections to adapt"
                    .into(),
            });
        }
        let halves = read_halves(bytes, weights_path, cfg, max_rank)?;
        let mut hash = Xxh3::new();
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (li, layer) in halves.into_iter().enumerate() {
            // Per target (in `ALL`'s order): `(lora_A, lora_B · s)` in f32, where targeted.
            let mut scaled: [Option<(Tensor, Tensor)>; 7] = Default::default();
            for (ti, half) in layer.into_iter().enumerate() {
                let Some(half) = half else { continue };
                let name = format!(
                    "layers.{li}.{}",
                    LoraTarget::ALL[ti].module(cfg.architecture)
                );
                let (Some(a), Some(b)) = half else {
                    return Err(DetspecError::file(
                        weights_path,
                        format!("{name} has only one of lora_A and lora_B"),
                    ));
                };
                let (r, rb) = (a.dim(0)?, b.dim(1)?);
                if rb != r {
                    return Err(DetspecError::file(
                        weights_path,
                        format!("{name}: lora_A has rank {r}, lora_B {rb}"),
                    ));
                }
                let scale = if config.use_rslora {
                    config.lora_alpha / (r as f64).sqrt()
                } else {
                    config.lora_alpha / r as f64
                };
                let b = (b * scale)?;
                hash.update(name.as_bytes());
                for t in [&a, &b] {
                    hash.update(bytemuck::cast_slice(&t.flatten_all()?.to_vec1::<f32>()?));
                }
                scaled[ti] = Some((a, b));
            }
            let place = |t: Tensor| -> Result<LinearWeight> {
                LinearWeight::new(&t.to_dtype(dtype)?.to_device(device)?, false)
            };
            let mut out: [Option<LoraPair>; 4] = Default::default();
            for (gi, group) in LoraTarget::GROUPS.iter().enumerate() {
                if let Some((down, up)) = group_pair(group, &scaled, cfg)? {
                    out[gi] = Some(LoraPair {
                        down: place(down)?,
                        up: place(up)?,
                    });
                }
            }
            layers.push(out);
        }
        if layers.iter().flatten().all(Option::is_none) {
            return Err(DetspecError::file(
                weights_path,
                "holds no lora_A/lora_B pair of a decoder layer",
            ));
        }
        Ok(Self {
            dir: weights_path.to_path_buf(),
            rank: config.r,
            layers,
            hash: hash.digest(),
        })
    }

    /// The directory it was loaded from (or the label it was sent under).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its `r` (`adapter_config.json`).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Content hash of its weights as applied (names the adapter in fingerprints and keeps its
    /// prefix-cache pages apart).
    pub fn content_hash(&self) -> u64 {
        self.hash
    }

    /// The pair of layer `layer`'s group `group` (an index into [`LoraTarget::GROUPS`]).
    fn pair(&self, layer: usize, group: usize) -> Option<&LoraPair> {
        self.layers.get(layer)?.get(group)?.as_ref()
    }
}

/// `group`'s stacked `lora_A`s (`[Σr, in]`) and block-diagonal `lora_B · s`s (`[Σout, Σr]`)
/// from one layer's scaled pairs (`scaled`, in `LoraTarget::ALL`'s order; f32 on the host), or
/// `None` where the adapter targets none of the group's layers.
fn group_pair(
    group: &[LoraTarget],
    scaled: &[Option<(Tensor, Tensor)>; 7],
    cfg: &ModelConfig,
) -> Result<Option<(Tensor, Tensor)>> {
    let pairs: Vec<(LoraTarget, Option<&(Tensor, Tensor)>)> = group
        .iter()
        .map(|&t| (t, scaled[target_index(t)].as_ref()))
        .collect();
    let downs: Vec<&Tensor> = pairs
        .iter()
        .filter_map(|(_, p)| p.map(|(a, _)| a))
        .collect();
    if downs.is_empty() {
        return Ok(None);
    }
    let down = Tensor::cat(&downs, 0)?;
    let rank_sum = down.dim(0)?;
    // Each target's rows of the block-diagonal matrix: its `B · s` in its own rank columns,
    // zeros elsewhere (all zeros for a target left alone).
    let mut col = 0;
    let mut rows = Vec::with_capacity(pairs.len());
    for (target, pair) in pairs {
        let (_, out) = target.dims(cfg);
        let Some((_, b)) = pair else {
            rows.push(Tensor::zeros((out, rank_sum), DType::F32, &Device::Cpu)?);
            continue;
        };
        let r = b.dim(1)?;
        rows.push(b.pad_with_zeros(1, col, rank_sum - col - r)?);
        col += r;
    }
    Ok(Some((down, Tensor::cat(&rows, 0)?)))
}

/// Every `lora_A` / `lora_B` of the safetensors `bytes` (of the file `path`) as f32, by
/// decoder layer and target (in `LoraTarget::ALL`'s order), each checked against the base
/// model's shapes and `max_rank`.
fn read_halves(
    bytes: &[u8],
    path: &Path,
    cfg: &ModelConfig,
    max_rank: usize,
) -> Result<Vec<[Option<HalfPair>; 7]>> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| DetspecError::file(path, format!("not a valid safetensors file: {e}")))?;
    let mut halves: Vec<[Option<HalfPair>; 7]> = (0..cfg.num_hidden_layers)
        .map(|_| Default::default())
        .collect();
    let mut names: Vec<&str> = st.names();
    names.sort_unstable();
    // A multimodal model's adapter may adapt its vision tower too; text never passes through it.
    for name in names.into_iter().filter(|n| !is_vision_name(n)) {
        let bad = |message: String| DetspecError::BadTensor {
            name: name.to_string(),
            path: path.to_path_buf(),
            message,
        };
        let own = engine_module_name(cfg, name);
        let (layer, module, targets, is_a) = parse_name(
            own.as_deref().unwrap_or(name),
            cfg.num_hidden_layers,
            cfg.architecture,
        )
        .map_err(bad)?;
        let attention_target = matches!(
            targets[0],
            LoraTarget::Q | LoraTarget::K | LoraTarget::V | LoraTarget::O
        );
        if let Some(mixer) = cfg.non_attention_mixer(layer).filter(|_| attention_target) {
            return Err(bad(format!(
                "layer {layer} is {mixer}, which has no {module}"
            )));
        }
        let mlp_target = matches!(
            targets[0],
            LoraTarget::Gate | LoraTarget::Up | LoraTarget::Down
        );
        // The adapters' MLP group is gate with up (one input, one GEMM pair); an ungated MLP
        // has no gate to stand beside its up.
        let ungated = cfg.architecture.ungated_mlp().is_some();
        if matches!(targets[0], LoraTarget::Gate | LoraTarget::Up) && ungated {
            return Err(bad(format!(
                "{module}: adapters of {:?}'s ungated MLP are supported on down_proj only",
                cfg.architecture
            )));
        }
        if mlp_target && !cfg.has_mlp(layer) {
            return Err(bad(format!(
                "layer {layer} holds a mixer and no MLP (Nemotron-H's layers hold one), so no \
                 {module}"
            )));
        }
        if mlp_target && cfg.moe.as_ref().is_some_and(|m| m.is_sparse(layer)) {
            return Err(bad(format!(
                "layer {layer}'s MLP is a mixture of experts, which has no {module}; adapters \
                 of experts and routers are not supported",
            )));
        }
        let view = st
            .tensor(name)
            .map_err(|e| bad(format!("cannot read: {e}")))?;
        let din = targets[0].dims(cfg).0;
        let dout: usize = targets.iter().map(|t| t.dims(cfg).1).sum();
        let shape = view.shape();
        // lora_A is [r, in], lora_B [out, r].
        let (r, fits) = match (is_a, shape) {
            (true, &[r, i]) => (r, i == din),
            (false, &[o, r]) => (r, o == dout),
            _ => (0, false),
        };
        if !fits || r == 0 || r > max_rank {
            return Err(bad(format!(
                "expected shape {} for {} of this model (rank 1..={max_rank}), found {shape:?}",
                if is_a {
                    format!("[r, {din}]")
                } else {
                    format!("[{dout}, r]")
                },
                module,
            )));
        }
        let dtype = match view.dtype() {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            other => return Err(bad(format!("expected a float tensor, found {other:?}"))),
        };
        let t = Tensor::from_raw_buffer(view.data(), dtype, shape, &Device::Cpu)
            .map_err(|e| bad(format!("cannot convert: {e}")))?
            .to_dtype(DType::F32)?;
        // A fused module's pair is its layers' pairs: `lora_A` shared, `lora_B`'s rows split
        // (each layer's delta is then the fused module's rows of it).
        let mut row = 0;
        for &target in targets {
            let half = halves[layer][target_index(target)].get_or_insert((None, None));
            if is_a {
                half.0 = Some(t.clone());
            } else {
                let out = target.dims(cfg).1;
                half.1 = Some(t.narrow(0, row, out)?.contiguous()?);
                row += out;
            }
        }
    }
    Ok(halves)
}

fn target_index(target: LoraTarget) -> usize {
    LoraTarget::ALL
        .iter()
        .position(|&t| t == target)
        .unwrap_or_default()
}

/// The adapter config in `text` (of the file `path`), checked.
fn parse_config(text: &str, path: &Path, max_rank: usize) -> Result<AdapterConfig> {
    let config: AdapterConfig = serde_json::from_str(text)
        .map_err(|e| DetspecError::file(path, format!("not a LoRA config: {e}")))?;
    check_config(&config, path, max_rank)?;
    Ok(config)
}

/// Refuses what would change the forward beyond `x A^T B^T s`.
fn check_config(c: &AdapterConfig, path: &Path, max_rank: usize) -> Result<()> {
    let refuse = |field: &str, message: String| {
        Err(DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        })
    };
    if let Some(t) = c.peft_type.as_deref().filter(|t| *t != "LORA") {
        return refuse(
            "peft_type",
            format!("\"{t}\": only LORA adapters are served"),
        );
    }
    if c.r == 0 || c.r > max_rank {
        return refuse(
            "r",
            format!("{}: the rank must be 1..={max_rank} (max_lora_rank)", c.r),
        );
    }
    if c.use_dora {
        return refuse("use_dora", "DoRA adapters are not supported".into());
    }
    if let Some(b) = c.bias.as_deref().filter(|b| *b != "none") {
        return refuse(
            "bias",
            format!("\"{b}\": adapters that train biases are not supported"),
        );
    }
    if c.fan_in_fan_out {
        return refuse(
            "fan_in_fan_out",
            "Conv1D-layout adapters (GPT-2) are not supported".into(),
        );
    }
    if c.modules_to_save
        .as_ref()
        .is_some_and(|m| !m.is_null() && m.as_array().is_none_or(|a| !a.is_empty()))
    {
        return refuse(
            "modules_to_save",
            "adapters that replace whole modules are not supported".into(),
        );
    }
    if c.alpha_pattern.as_ref().is_some_and(|p| !p.is_empty()) {
        return refuse(
            "alpha_pattern",
            "per-module lora_alpha is not supported".into(),
        );
    }
    Ok(())
}

/// An adapter tensor's name with its layer's module as the engine names it, where the model's
/// checkpoints name it otherwise (Nemotron-H's `layers.3.mixer.q_proj` →
/// `layers.3.self_attn.q_proj`); `None` where they do not.
fn engine_module_name(cfg: &ModelConfig, name: &str) -> Option<String> {
    let (before, rest) = name.split_once("layers.")?;
    let (layer, field) = rest.split_once('.')?;
    let own = super::nemotron_h_names::field_in_layer(cfg, layer.parse().ok()?, field)?;
    Some(format!("{before}layers.{layer}.{own}"))
}

/// `(layer, module, its targets, is lora_A)` of a PEFT tensor name
/// (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`) on a model that stores
/// q/k/v and gate/up as `arch` does ([`LoraTarget::of_module`]), or why not.
fn parse_name(
    name: &str,
    num_layers: usize,
    arch: Architecture,
) -> std::result::Result<(usize, &str, &'static [LoraTarget], bool), String> {
    let fused = arch.fused();
    let unsupported = || {
        let modules = format!(
            "{}/o/{}/down",
            if fused.qkv { "qkv" } else { "q/k/v" },
            if fused.gate_up { "gate_up" } else { "gate/up" }
        );
        format!(
            "not a lora_A/lora_B weight of a decoder layer's {modules} projection (adapters of \
             embeddings, the LM head, MoE experts and routers or other modules are not \
             supported)"
        )
    };
    let rest = name
        .split_once("layers.")
        .map(|(_, r)| r)
        .ok_or_else(unsupported)?;
    let (layer, rest) = rest.split_once('.').ok_or_else(unsupported)?;
    let layer: usize = layer.parse().map_err(|_| unsupported())?;
    if layer >= num_layers {
        return Err(format!(
            "layer {layer}, but the model has {num_layers} layers"
        ));
    }
    for (suffix, is_a) in [(".lora_A.weight", true), (".lora_B.weight", false)] {
        if let Some(module) = rest.strip_suffix(suffix) {
            if let Some(targets) = LoraTarget::of_module(module, arch) {
                return Ok((layer, module, targets, is_a));
            }
        }
    }
    Err(unsupported())
}

/// The adapters of one forward's rows, grouped: built once per forward, and `None` when no row
/// has one (the base model's forward is then exactly what it was without adapters).
pub(super) struct LoraRows {
    groups: Vec<LoraGroup>,
}

/// One adapter's rows of a forward.
struct LoraGroup {
    adapter: Arc<LoraAdapter>,
    /// Row indices on the device; `None`: every row of the batch (one adapter serving all).
    rows: Option<Tensor>,
}

/// Some linear layers' outputs of one input, each with the targets it holds side by side
/// along its columns (one layer, or a stacked projection's parts).
pub(super) type LoraOutputs<'a> = Vec<(Tensor, &'a [LoraTarget])>;

impl LoraRows {
    /// Groups a batch's rows by the adapter of their sequence (`adapters[row_seq[row]]`);
    /// row indices on `device`.
    pub(super) fn of(
        row_seq: &[u32],
        adapters: &[Option<Arc<LoraAdapter>>],
        device: &Device,
    ) -> Result<Option<Self>> {
        if adapters.iter().all(Option::is_none) {
            return Ok(None);
        }
        let mut groups: Vec<(Arc<LoraAdapter>, Vec<u32>)> = Vec::new();
        for (row, &si) in row_seq.iter().enumerate() {
            let Some(Some(adapter)) = adapters.get(si as usize) else {
                continue;
            };
            match groups.iter_mut().find(|(a, _)| Arc::ptr_eq(a, adapter)) {
                Some((_, rows)) => rows.push(row as u32),
                None => groups.push((adapter.clone(), vec![row as u32])),
            }
        }
        let all = row_seq.len();
        let groups = groups
            .into_iter()
            .map(|(adapter, rows)| {
                let n = rows.len();
                let rows = (n < all)
                    .then(|| Tensor::from_vec(rows, n, device))
                    .transpose()?;
                Ok(LoraGroup { adapter, rows })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Self { groups }))
    }

    /// `outs` (the base outputs of `x` through decoder layer `layer`'s linear layers: one
    /// [`LoraTarget::GROUPS`] entry's targets, in its order, one layer or a stacked projection
    /// per output) plus each group's deltas on its rows. Per adapter group, `x`'s rows are
    /// gathered once (padded once to the invariant GEMM's row blocks where it pads) and the
    /// deltas of every output come out of one GEMM pair; a group of every row adds its delta to
    /// the whole output (the same one f32 add per element as adding it row by row).
    pub(super) fn add(
        &self,
        x: &Tensor,
        layer: usize,
        outs: LoraOutputs<'_>,
    ) -> candle_core::Result<Vec<Tensor>> {
        // The adapters' GEMMs always run on the invariant kernels: a row's delta is then the
        // same on the fast and the verify path, whatever the batch.
        let gemm = GemmOptions {
            profile: KernelProfile::Invariant,
            invariant: true,
            amx: false,
        };
        let targets: Vec<LoraTarget> = outs.iter().flat_map(|(_, ts)| ts.iter().copied()).collect();
        let group = LoraTarget::GROUPS
            .iter()
            .position(|g| *g == targets.as_slice())
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "LoRA: {targets:?} is not a group of layers that read one input"
                ))
            })?;
        let width = outs
            .iter()
            .map(|(y, _)| y.dim(1))
            .sum::<candle_core::Result<usize>>()?;
        let mut outs = outs;
        for g in &self.groups {
            let Some(pair) = g.adapter.pair(layer, group) else {
                continue;
            };
            let xs = match &g.rows {
                Some(rows) => x.index_select(rows, 0)?,
                None => x.clone(),
            };
            let m = xs.dim(0)?;
            let padded = pair
                .down
                .invariant_row_block()
                .map_or(m, |block| m.div_ceil(block) * block);
            let xs = if padded > m {
                xs.pad_with_zeros(0, 0, padded - m)?
            } else {
                xs
            };
            let delta = pair.up.matmul(&pair.down.matmul(&xs, gemm)?, gemm)?;
            if delta.dim(1)? != width {
                return Err(candle_core::Error::Msg(format!(
                    "LoRA: the adapter's deltas of {targets:?} are {} wide, the layers' outputs {width}",
                    delta.dim(1)?
                )));
            }
            let delta = delta.narrow(0, 0, m)?;
            let mut col = 0;
            for (y, _) in outs.iter_mut() {
                let w = y.dim(1)?;
                let d = if w == width {
                    delta.clone()
                } else {
                    delta.narrow(1, col, w)?.contiguous()?
                };
                col += w;
                let d = d.to_dtype(y.dtype())?;
                *y = match &g.rows {
                    Some(rows) => y.index_add(rows, &d, 0)?,
                    None => (&*y + &d)?,
                };
            }
        }
        Ok(outs.into_iter().map(|(y, _)| y).collect())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::ops::tensor_bits as bits;

    #[test]
    fn fused_models_take_their_fused_module_names_only() {
        use LoraTarget::*;
        let of = LoraTarget::of_module;
        let (phi3, glm, llama) = (Architecture::Phi3, Architecture::Glm4, Architecture::Llama);
        assert_eq!(of("self_attn.qkv_proj", phi3), Some(&[Q, K, V][..]));
        assert_eq!(of("mlp.gate_up_proj", phi3), Some(&[Gate, Up][..]));
        assert_eq!(of("self_attn.o_proj", phi3), Some(&[O][..]));
        assert_eq!(of("mlp.down_proj", phi3), Some(&[Down][..]));
        assert_eq!(of("self_attn.q_proj", phi3), None);
        assert_eq!(of("mlp.up_proj", phi3), None);
        assert_eq!(of("self_attn.qkv_proj", llama), None);
        assert_eq!(of("mlp.up_proj", llama), Some(&[Up][..]));
        // GLM: q/k/v apart, gate/up fused.
        assert_eq!(of("self_attn.q_proj", glm), Some(&[Q][..]));
        assert_eq!(of("self_attn.qkv_proj", glm), None);
        assert_eq!(of("mlp.gate_up_proj", glm), Some(&[Gate, Up][..]));
        assert_eq!(of("mlp.gate_proj", glm), None);
        // Granite 4: its MLP under its own names only.
        let granite = Architecture::GraniteMoeHybrid;
        assert_eq!(
            of("shared_mlp.input_linear", granite),
            Some(&[Gate, Up][..])
        );
        assert_eq!(of("shared_mlp.output_linear", granite), Some(&[Down][..]));
        assert_eq!(of("self_attn.q_proj", granite), Some(&[Q][..]));
        assert_eq!(of("mlp.down_proj", granite), None);
        assert_eq!(of("mlp.gate_up_proj", granite), None);
        assert_eq!(of("shared_mlp.input_linear", llama), None);
        // LFM2: its own names for o and the MLP; the Llama names are none of its modules.
        let lfm2 = Architecture::Lfm2;
        assert_eq!(of("self_attn.out_proj", lfm2), Some(&[O][..]));
        assert_eq!(of("feed_forward.w1", lfm2), Some(&[Gate][..]));
        assert_eq!(of("feed_forward.w3", lfm2), Some(&[Up][..]));
        assert_eq!(of("feed_forward.w2", lfm2), Some(&[Down][..]));
        assert_eq!(of("self_attn.q_proj", lfm2), Some(&[Q][..]));
        assert_eq!(of("self_attn.o_proj", lfm2), None);
        assert_eq!(of("mlp.gate_proj", lfm2), None);
        assert_eq!(of("conv.out_proj", lfm2), None);
        let e = parse_name("model.layers.0.self_attn.q_proj.lora_A.weight", 2, phi3).unwrap_err();
        assert!(e.contains("qkv/o/gate_up/down"), "{e}");
        let e = parse_name("model.layers.0.mlp.up_proj.lora_A.weight", 2, glm).unwrap_err();
        assert!(e.contains("q/k/v/o/gate_up/down"), "{e}");
    }

    /// `n` values in [-1, 1) from `seed` (a fixed LCG: the cases replay).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn matrix(seed: u64, rows: usize, cols: usize) -> Tensor {
        Tensor::from_vec(values(seed, rows * cols), (rows, cols), &Device::Cpu).unwrap()
    }

    fn llama_config() -> ModelConfig {
        ModelConfig::from_json_str(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 48,
            "intermediate_size": 80, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 50}"#,
            Path::new("/m/config.json"),
        )
        .unwrap()
    }

    /// An adapter of one layer targeting q and v (PEFT's default), its pairs held `dense`
    /// (`[in, out]`, what a GPU holds: the GEMMs pad to row blocks) or packed (the CPU's).
    fn q_v_adapter(cfg: &ModelConfig, seed: u64, dense: bool) -> Arc<LoraAdapter> {
        let mut scaled: [Option<(Tensor, Tensor)>; 7] = Default::default();
        for (i, t) in [LoraTarget::Q, LoraTarget::V].into_iter().enumerate() {
            let (din, dout) = t.dims(cfg);
            let s = seed + 2 * i as u64;
            scaled[target_index(t)] = Some((matrix(s, 3, din), matrix(s + 1, dout, 3)));
        }
        let (down, up) = group_pair(LoraTarget::GROUPS[0], &scaled, cfg)
            .unwrap()
            .unwrap();
        let place = |t: Tensor| {
            if dense {
                LinearWeight::Dense(t.t().unwrap().contiguous().unwrap())
            } else {
                LinearWeight::new(&t, false).unwrap()
            }
        };
        Arc::new(LoraAdapter {
            dir: PathBuf::new(),
            rank: 3,
            layers: vec![[
                Some(LoraPair {
                    down: place(down),
                    up: place(up),
                }),
                None,
                None,
                None,
            ]],
            hash: seed,
        })
    }

    /// The padded path (dense weights, as on a GPU) gives the packed path's deltas, over
    /// row counts below, at and past one 16-row block, for a group of every row and of some
    /// rows, with the outputs apart (the CPU's q, k, v) and stacked (a GPU's): it runs on the
    /// CPU here, where candle's matmul stands in for the GPU's.
    #[test]
    fn padded_dense_pairs_give_the_packed_pairs_deltas() {
        let cfg = llama_config();
        let widths: Vec<usize> = LoraTarget::GROUPS[0]
            .iter()
            .map(|t| t.dims(&cfg).1)
            .collect();
        for rows in [1usize, 5, 16, 20, 33] {
            let x = matrix(rows as u64, rows, cfg.hidden_size);
            // Rows alternate between the adapter and none (a group of some rows), or all run it.
            for every_row in [false, true] {
                let seqs: Vec<u32> = (0..rows as u32).map(|r| r % 2).collect();
                let run = |dense: bool, stacked: bool| -> Vec<f32> {
                    let a = q_v_adapter(&cfg, 11, dense);
                    let adapters = if every_row {
                        vec![Some(a.clone()), Some(a)]
                    } else {
                        vec![Some(a), None]
                    };
                    let lora = LoraRows::of(&seqs, &adapters, &Device::Cpu)
                        .unwrap()
                        .unwrap();
                    let ts = LoraTarget::GROUPS[0];
                    let apart: Vec<Tensor> = (0..3)
                        .map(|i| matrix(1 + i as u64, rows, widths[i]))
                        .collect();
                    let outs: LoraOutputs<'_> = if stacked {
                        vec![(Tensor::cat(&apart, 1).unwrap(), ts)]
                    } else {
                        apart
                            .into_iter()
                            .enumerate()
                            .map(|(i, y)| (y, &ts[i..i + 1]))
                            .collect()
                    };
                    let ys = lora.add(&x, 0, outs).unwrap();
                    // Side by side, whatever the layout.
                    let ys: Vec<Tensor> = if stacked {
                        ys
                    } else {
                        vec![Tensor::cat(&ys, 1).unwrap()]
                    };
                    ys[0].flatten_all().unwrap().to_vec1::<f32>().unwrap()
                };
                let packed = run(false, false);
                for (dense, stacked) in [(true, false), (true, true), (false, true)] {
                    let got = run(dense, stacked);
                    assert_eq!(got.len(), packed.len());
                    for (g, p) in got.iter().zip(&packed) {
                        assert!((g - p).abs() <= 1e-5 * (1.0 + p.abs()), "{g} vs {p}");
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// A group's one GEMM pair gives each targeted layer the delta of its own pair, bit
        /// for bit, and zeros for the layers left alone: on the CPU the block-diagonal matrix
        /// only adds exact zero products to each element's chain.
        #[test]
        fn a_groups_gemm_pair_gives_each_layers_own_delta_bits(
            seed in any::<u64>(),
            rows in 1usize..40,
            ranks in proptest::collection::vec(0usize..6, 3),
            bf16 in any::<bool>(),
        ) {
            let cfg = ModelConfig::from_json_str(
                r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 48,
                "intermediate_size": 80, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 50}"#,
                Path::new("/m/config.json"),
            )
            .unwrap();
            let group = LoraTarget::GROUPS[0]; // q, k, v; a rank of 0: not targeted
            let mut scaled: [Option<(Tensor, Tensor)>; 7] = Default::default();
            for (i, (&t, &r)) in group.iter().zip(&ranks).enumerate() {
                let (din, dout) = t.dims(&cfg);
                if r > 0 {
                    let s = seed.wrapping_add(2 * i as u64);
                    scaled[target_index(t)] = Some((matrix(s, r, din), matrix(s + 1, dout, r)));
                }
            }
            let dtype = if bf16 { DType::BF16 } else { DType::F32 };
            let place = |t: &Tensor| LinearWeight::new(&t.to_dtype(dtype).unwrap(), false).unwrap();
            let gemm = GemmOptions { profile: KernelProfile::Invariant, invariant: true, amx: false };
            let x = matrix(seed ^ 0x5eed, rows, cfg.hidden_size);
            let fused = group_pair(group, &scaled, &cfg).unwrap();
            prop_assert_eq!(fused.is_some(), ranks.iter().any(|&r| r > 0));
            let Some((down, up)) = fused else { return Ok(()) };
            let delta = place(&up).matmul(&place(&down).matmul(&x, gemm).unwrap(), gemm).unwrap();
            let mut col = 0;
            for &t in group {
                let (_, dout) = t.dims(&cfg);
                let got = delta.narrow(1, col, dout).unwrap().contiguous().unwrap();
                col += dout;
                match &scaled[target_index(t)] {
                    Some((a, b)) => {
                        let own = place(b).matmul(&place(a).matmul(&x, gemm).unwrap(), gemm).unwrap();
                        prop_assert_eq!(bits(&got), bits(&own), "{:?}", t);
                    }
                    None => prop_assert!(bits(&got).iter().all(|&b| b == 0), "{:?}", t),
                }
            }
            prop_assert_eq!(col, delta.dim(1).unwrap());
        }
    }
}
