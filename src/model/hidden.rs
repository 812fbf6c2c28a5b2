//! Several hidden states of one forward pass (`embed --layers`): the layers run once, each
//! requested state is kept as it goes by.

use burn::tensor::{Int, Tensor};

use crate::error::Result;
use crate::model::cache::Past;
use crate::model::GenSlm;

impl GenSlm {
    /// [`GenSlm::hidden_state`] of each of `layers` (Hugging Face's numbering: 0 = the
    /// embeddings, `i` = the output of layer `i`, `num_layers` = after the final LayerNorm),
    /// in the order asked, from one pass that runs only the layers the deepest one needs.
    pub fn hidden_states_at(
        &self,
        tokens: Tensor<2, Int>,
        layers: &[usize],
    ) -> Result<Vec<Tensor<3>>> {
        let s = tokens.dims()[1];
        let mut x = self.embed(tokens, 0)?;
        let ctx = self.layer_context(0, s);
        let n = self.layout.layers.len();
        let mut out: Vec<Option<Tensor<3>>> = vec![None; layers.len()];
        let deepest = layers.iter().copied().max().unwrap_or(0).min(n);
        for li in 0..=deepest {
            if li > 0 {
                x = self.layer(li - 1, x, &ctx, Past::None).0;
            }
            for (slot, &want) in out.iter_mut().zip(layers) {
                if want.min(n) == li {
                    let state = if want >= n {
                        self.final_norm(x.clone())
                    } else {
                        x.clone()
                    };
                    *slot = Some(self.full(state));
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|t| t.expect("every layer is at most the deepest"))
            .collect())
    }
}
