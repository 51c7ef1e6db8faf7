//! A checkpoint's `quantization_config`: the quantized formats detspec reads, and how their
//! weights are laid out.
//!
//! Read: gpt-oss's MXFP4 experts (`quant_method: mxfp4`), and FP8 weights, the format model
//! makers publish beside (or instead of) bf16: transformers' `fp8` (DeepSeek-V3/R1, Qwen3's
//! `-FP8` checkpoints: 128 × 128 blocks; Mistral's Ministral 3: one scale per matrix) and
//! compressed-tensors' float 8-bit schemes (llm-compressor's `FP8`/`FP8_DYNAMIC`/`FP8_BLOCK`:
//! per channel, per matrix or per block). Everything else (GPTQ, AWQ, bitsandbytes, integer
//! compressed-tensors, ...) is refused naming the field, before any tensor is read.

use serde_json::Value;

/// FP8 linear weights: each `[out, in]` matrix stored as E4M3 codes (`…weight`, dtype
/// `F8_E4M3`) beside scales (`…weight` + [`Self::scale_suffix`]), one per `block` of the
/// matrix; a weight is its code's value times its block's scale. Which matrices are FP8 is read
/// from each tensor's dtype (the LM head and the embedding are usually not), so the config's
/// module lists are not needed.
///
/// Activations are not quantized: the GEMMs multiply the widened weights by the activations
/// in the engine's dtype (as transformers runs these checkpoints with `dequantize=True`), so an
/// FP8 checkpoint gives the bits of the checkpoint of its widened weights. The configs'
/// activation schemes (`dynamic`, or `static` with stored input scales) are not read: they
/// tell an FP8 GEMM how to quantize its inputs, which detspec does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Weights {
    /// Rows and columns of the matrix that one scale covers; `None`: the whole dimension (a
    /// scale per output channel is `[Some(1), None]`, one per matrix `[None, None]`).
    pub block: [Option<usize>; 2],
    /// The scales' name, after the weight's (`…weight_scale_inv` in transformers' format,
    /// `…weight_scale` in compressed-tensors').
    pub scale_suffix: &'static str,
}

impl Fp8Weights {
    /// The scales' shape for an `[rows, cols]` matrix: one per block, the last blocks of a
    /// dimension that the block size does not divide cut short.
    pub fn scale_shape(&self, rows: usize, cols: usize) -> [usize; 2] {
        let [br, bc] = self.block_dims(rows, cols);
        [rows.div_ceil(br), cols.div_ceil(bc)]
    }

    /// The block's rows and columns in an `[rows, cols]` matrix.
    pub fn block_dims(&self, rows: usize, cols: usize) -> [usize; 2] {
        [self.block[0].unwrap_or(rows), self.block[1].unwrap_or(cols)]
    }
}

/// The quantized format a checkpoint declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantization {
    /// MXFP4 (gpt-oss's experts).
    Mxfp4,
    /// FP8 linear weights.
    Fp8(Fp8Weights),
}

/// A field of `quantization_config` at fault, and why.
pub type QuantError = (String, String);

/// Reads `quantization_config` (`q`). Errors name the field under `quantization_config`.
pub fn parse_quantization(q: &Value) -> Result<Quantization, QuantError> {
    let bad = |field: &str, message: &str| {
        Err((format!("quantization_config.{field}"), message.to_string()))
    };
    let Some(method) = q.get("quant_method") else {
        return Err((
            "quantization_config".into(),
            "a quantized checkpoint without `quant_method`: detspec loads float32, bfloat16 and \
             float16 weights, FP8 and gpt-oss's MXFP4"
                .into(),
        ));
    };
    match method.as_str() {
        Some("mxfp4") => Ok(Quantization::Mxfp4),
        Some("fp8") => {
            if let Some(fmt) = q.get("fmt").filter(|v| !v.is_null()) {
                if fmt.as_str() != Some("e4m3") {
                    return bad("fmt", &format!("{fmt}: FP8 weights are read in E4M3 only"));
                }
            }
            if let Some(f) = q.get("scale_fmt").filter(|v| !v.is_null()) {
                if f.as_str() != Some("float") {
                    return bad(
                        "scale_fmt",
                        &format!("{f}: FP8 scales are read as floats only"),
                    );
                }
            }
            let block = match q.get("weight_block_size") {
                None | Some(Value::Null) => [None, None],
                Some(v) => match block_of(v) {
                    Some(b) => b,
                    None => {
                        return bad(
                            "weight_block_size",
                            &format!("{v}: expected two positive integers or null"),
                        )
                    }
                },
            };
            Ok(Quantization::Fp8(Fp8Weights {
                block,
                scale_suffix: "_scale_inv",
            }))
        }
        Some("compressed-tensors") => compressed_tensors(q),
        Some(other) => bad(
            "quant_method",
            &format!(
                "{other}: this quantized format is not supported (detspec loads float32, \
                 bfloat16 and float16 weights, FP8 and gpt-oss's MXFP4); load the unquantized \
                 checkpoint"
            ),
        ),
        None => bad("quant_method", &format!("{method}: expected a string")),
    }
}

/// `[rows, cols]`, both positive.
fn block_of(v: &Value) -> Option<[Option<usize>; 2]> {
    let dims = v.as_array()?;
    let dim = |i: usize| -> Option<usize> {
        let d = usize::try_from(dims.get(i)?.as_u64()?).ok()?;
        (d > 0).then_some(d)
    };
    (dims.len() == 2).then_some([Some(dim(0)?), Some(dim(1)?)])
}

/// compressed-tensors' float 8-bit weight schemes: every config group's weights the same
/// E4M3 scheme, per channel, tensor or block.
fn compressed_tensors(q: &Value) -> Result<Quantization, QuantError> {
    let bad =
        |field: String, message: String| Err((format!("quantization_config.{field}"), message));
    let format = q.get("format").and_then(Value::as_str);
    if format != Some("float-quantized") {
        return bad(
            "format".into(),
            format!(
                "{}: of compressed-tensors' formats detspec reads `float-quantized` (FP8 \
                 weights) only; load the unquantized checkpoint",
                format.unwrap_or("missing")
            ),
        );
    }
    let Some(groups) = q.get("config_groups").and_then(Value::as_object) else {
        return bad("config_groups".into(), "missing, or not an object".into());
    };
    let mut scheme = None;
    for (name, group) in groups {
        let field = format!("config_groups.{name}.weights");
        let Some(w) = group.get("weights").filter(|w| !w.is_null()) else {
            return bad(field, "missing: every group must quantize weights".into());
        };
        let num_bits = w.get("num_bits").and_then(Value::as_u64);
        let kind = w.get("type").and_then(Value::as_str);
        if num_bits != Some(8) || kind != Some("float") {
            return bad(
                field,
                format!(
                    "{} bits of type {}: detspec reads 8-bit float (FP8) weights only",
                    num_bits.map_or("?".into(), |b| b.to_string()),
                    kind.unwrap_or("?")
                ),
            );
        }
        let block = match w.get("strategy").and_then(Value::as_str) {
            Some("tensor") => [None, None],
            Some("channel") => [Some(1), None],
            Some("block") => match w.get("block_structure").and_then(block_of) {
                Some(b) => b,
                None => {
                    return bad(
                        format!("{field}.block_structure"),
                        "expected two positive integers".into(),
                    )
                }
            },
            other => {
                return bad(
                    format!("{field}.strategy"),
                    format!(
                        "{}: FP8 weights are read per tensor, channel or block",
                        other.unwrap_or("missing")
                    ),
                )
            }
        };
        if scheme.is_some_and(|s| s != block) {
            return bad(
                "config_groups".into(),
                "groups with different weight schemes are not supported".into(),
            );
        }
        scheme = Some(block);
    }
    let Some(block) = scheme else {
        return bad("config_groups".into(), "no group".into());
    };
    Ok(Quantization::Fp8(Fp8Weights {
        block,
        scale_suffix: "_scale",
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fp8(q: Value) -> Result<Fp8Weights, QuantError> {
        match parse_quantization(&q)? {
            Quantization::Fp8(w) => Ok(w),
            Quantization::Mxfp4 => panic!("not FP8"),
        }
    }

    #[test]
    fn fp8_formats_read_their_blocks_and_scale_names() {
        // DeepSeek-V3 / Qwen3-FP8
        let w = fp8(
            json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}),
        )
        .unwrap();
        assert_eq!(w.block, [Some(128), Some(128)]);
        assert_eq!(w.scale_suffix, "_scale_inv");
        assert_eq!(w.scale_shape(300, 256), [3, 2]);
        // Ministral 3: one scale per matrix, static activations
        let w = fp8(json!({"quant_method": "fp8", "activation_scheme": "static",
                           "weight_block_size": null, "dequantize": false}))
        .unwrap();
        assert_eq!(w.block, [None, None]);
        assert_eq!(w.scale_shape(300, 256), [1, 1]);
        // llm-compressor's FP8_DYNAMIC
        let w = fp8(
            json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                            "symmetric": true, "dynamic": false},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": true}}},
            "ignore": ["lm_head"], "kv_cache_scheme": null}),
        )
        .unwrap();
        assert_eq!(w.block, [Some(1), None]);
        assert_eq!(w.scale_suffix, "_scale");
        assert_eq!(w.scale_shape(300, 256), [300, 1]);
    }

    #[test]
    fn other_formats_are_refused_naming_the_field() {
        for (q, field) in [
            (
                json!({"quant_method": "awq", "bits": 4}),
                "quantization_config.quant_method",
            ),
            (json!({"bits": 4}), "quantization_config"),
            (
                json!({"quant_method": "fp8", "fmt": "e5m2"}),
                "quantization_config.fmt",
            ),
            (
                json!({"quant_method": "fp8", "scale_fmt": "ue8m0"}),
                "quantization_config.scale_fmt",
            ),
            (
                json!({"quant_method": "fp8", "weight_block_size": [128, 0]}),
                "quantization_config.weight_block_size",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "pack-quantized"}),
                "quantization_config.format",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "float-quantized",
                       "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                           "strategy": "group"}}}}),
                "quantization_config.config_groups.g.weights",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "float-quantized",
                       "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                                           "strategy": "token"}}}}),
                "quantization_config.config_groups.g.weights.strategy",
            ),
        ] {
            let (f, message) = parse_quantization(&q).unwrap_err();
            assert_eq!(f, field, "{q}: {message}");
        }
    }
}
