//! Apertus's xIELU activation's parameters (`mlp.act_fn.*`), read from a checkpoint and
//! replaced by name in a weight update.

use crate::error::Result;
use crate::ops;

use super::loader::WeightLoader;

/// Apertus's xIELU parameters as its checkpoint holds them (`mlp.act_fn.*`: `alpha_p` and
/// `alpha_n` before their softplus, `beta`, `eps`), so that an update replaces one and the
/// activation follows.
#[derive(Debug, Clone, Copy)]
pub(super) struct XieluParams {
    pub(super) alpha_p: f32,
    pub(super) alpha_n: f32,
    pub(super) beta: f32,
    pub(super) eps: f32,
}

impl XieluParams {
    /// The parameter names under `mlp.act_fn` and their shapes on file.
    pub(super) const NAMES: [(&'static str, &'static [usize]); 4] = [
        ("alpha_p", &[1]),
        ("alpha_n", &[1]),
        ("beta", &[]),
        ("eps", &[]),
    ];

    pub(super) fn load(ld: &WeightLoader<'_>, prefix: &str) -> Result<Self> {
        let mut v = [0f32; 4];
        for (slot, (name, shape)) in v.iter_mut().zip(Self::NAMES) {
            let t = ld.load_f32(&format!("{prefix}.{name}"), shape)?;
            *slot = t
                .flatten_all()?
                .to_vec1::<f32>()?
                .first()
                .copied()
                .unwrap_or(0.0);
        }
        let [alpha_p, alpha_n, beta, eps] = v;
        Ok(Self {
            alpha_p,
            alpha_n,
            beta,
            eps,
        })
    }

    pub(super) fn act(&self) -> ops::Xielu {
        ops::Xielu::from_params(self.alpha_p, self.alpha_n, self.beta, self.eps)
    }

    /// The parameter `name` (one of [`Self::NAMES`]).
    pub(super) fn param_mut(&mut self, name: &str) -> Option<&mut f32> {
        match name {
            "alpha_p" => Some(&mut self.alpha_p),
            "alpha_n" => Some(&mut self.alpha_n),
            "beta" => Some(&mut self.beta),
            "eps" => Some(&mut self.eps),
            _ => None,
        }
    }
}
