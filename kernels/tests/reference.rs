//! The independent reference: naive attention and its backward in f64, one row at a time.

pub struct Case {
    pub b: usize,
    pub h: usize,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    pub causal: bool,
    pub alibi: Option<Vec<f64>>,
    pub q_off: usize,
    pub k_off: usize,
}

pub struct Grads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

impl Case {
    /// The row of probabilities of query `i` of head `bh` (all zero when it sees no key),
    /// and its log-sum-exp.
    fn probs(&self, q: &[f64], k: &[f64], bh: usize, i: usize) -> (Vec<f64>, f64) {
        let (d, sq, sk) = (self.d, self.sq, self.sk);
        let scale = 1.0 / (d as f64).sqrt();
        let qrow = &q[(bh * sq + i) * d..][..d];
        let qpos = (self.q_off + i) as f64;
        let mut s = vec![f64::NEG_INFINITY; sk];
        for (j, sj) in s.iter_mut().enumerate() {
            let kpos = (self.k_off + j) as f64;
            if self.causal && kpos > qpos {
                continue;
            }
            let krow = &k[(bh * sk + j) * d..][..d];
            let mut dot: f64 = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>() * scale;
            if let Some(sl) = &self.alibi {
                let dist = qpos - kpos;
                let dist = if self.causal { dist } else { dist.abs() };
                dot -= sl[bh % self.h] * dist;
            }
            *sj = dot;
        }
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            return (vec![0.0; sk], f64::NEG_INFINITY);
        }
        let mut p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let l: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= l);
        (p, m + l.ln())
    }

    /// `(o, lse)`.
    pub fn forward(&self, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let (d, sq, sk) = (self.d, self.sq, self.sk);
        let mut o = vec![0.0; self.b * self.h * sq * d];
        let mut lse = vec![0.0; self.b * self.h * sq];
        for bh in 0..self.b * self.h {
            for i in 0..sq {
                let (p, l) = self.probs(q, k, bh, i);
                lse[bh * sq + i] = l;
                let orow = &mut o[(bh * sq + i) * d..][..d];
                for (j, pj) in p.iter().enumerate() {
                    if *pj != 0.0 {
                        let vrow = &v[(bh * sk + j) * d..][..d];
                        orow.iter_mut().zip(vrow).for_each(|(a, b)| *a += pj * b);
                    }
                }
            }
        }
        (o, lse)
    }

    /// Gradients of `Σ o ∘ d_o` with respect to q, k, v.
    pub fn backward(&self, q: &[f64], k: &[f64], v: &[f64], d_o: &[f64]) -> Grads {
        let (d, sq, sk) = (self.d, self.sq, self.sk);
        let scale = 1.0 / (d as f64).sqrt();
        let mut g = Grads {
            dq: vec![0.0; q.len()],
            dk: vec![0.0; k.len()],
            dv: vec![0.0; v.len()],
        };
        for bh in 0..self.b * self.h {
            for i in 0..sq {
                let (p, _) = self.probs(q, k, bh, i);
                let dorow = &d_o[(bh * sq + i) * d..][..d];
                let qrow = &q[(bh * sq + i) * d..][..d];
                // dP_j = dO_i · v_j; dS_j = P_j (dP_j − Σ_k P_k dP_k).
                let dp: Vec<f64> = (0..sk)
                    .map(|j| {
                        let vrow = &v[(bh * sk + j) * d..][..d];
                        dorow.iter().zip(vrow).map(|(a, b)| a * b).sum()
                    })
                    .collect();
                let pdp: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..sk {
                    if p[j] == 0.0 {
                        continue;
                    }
                    let ds = p[j] * (dp[j] - pdp) * scale;
                    let krow = &k[(bh * sk + j) * d..][..d];
                    for c in 0..d {
                        g.dq[(bh * sq + i) * d + c] += ds * krow[c];
                        g.dk[(bh * sk + j) * d + c] += ds * qrow[c];
                        g.dv[(bh * sk + j) * d + c] += p[j] * dorow[c];
                    }
                }
            }
        }
        g
    }
}
