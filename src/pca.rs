//! Principal component analysis for embedding plots: small, deterministic, dependency-free.
//!
//! The data are centred; the eigenvectors of the sample covariance `XᵀX/(n−1)` (d×d) are found,
//! or, when there are fewer rows than columns, those of the Gram matrix `XXᵀ/(n−1)` (n×n, the
//! same non-zero eigenvalues; components are mapped back with `v = Xᵀu / √((n−1)λ)`). A matrix
//! of order ≤ 128 is diagonalised completely with cyclic Jacobi rotations; a larger one by
//! subspace iteration (k + 10 vectors, Rayleigh–Ritz with Jacobi, from a fixed seed) until the
//! top k residuals are below 1e-9 of the largest eigenvalue. Each component's sign is fixed so
//! that its largest-magnitude coordinate is positive, so results are reproducible.

use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// A fitted PCA.
#[derive(Debug, Clone, PartialEq)]
pub struct Pca {
    /// Column means (length d).
    pub mean: Vec<f64>,
    /// k unit vectors of length d, by decreasing variance.
    pub components: Vec<Vec<f64>>,
    /// Variance along each component (eigenvalues of the covariance).
    pub explained_variance: Vec<f64>,
    /// Total variance (trace of the covariance).
    pub total_variance: f64,
    /// Projections of the rows, `n × k` row-major.
    pub scores: Vec<f64>,
}

impl Pca {
    /// Share of the total variance along component `i`.
    pub fn ratio(&self, i: usize) -> f64 {
        if self.total_variance > 0.0 {
            self.explained_variance[i] / self.total_variance
        } else {
            0.0
        }
    }
}

/// Symmetric eigendecomposition by cyclic Jacobi: eigenvalues (decreasing) and the matching
/// eigenvectors as rows. `a` is `m × m` row-major.
pub fn jacobi_eigen(a: &[f64], m: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    let mut a = a.to_vec();
    let mut v = vec![0.0; m * m];
    for i in 0..m {
        v[i * m + i] = 1.0;
    }
    let norm: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    for _sweep in 0..100 {
        let off: f64 = (0..m)
            .flat_map(|i| (0..m).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * m + j] * a[i * m + j])
            .sum::<f64>()
            .sqrt();
        if off <= 1e-15 * norm.max(f64::MIN_POSITIVE) {
            break;
        }
        for p in 0..m {
            for q in p + 1..m {
                let apq = a[p * m + q];
                if apq.abs() <= f64::MIN_POSITIVE {
                    continue;
                }
                let (app, aqq) = (a[p * m + p], a[q * m + q]);
                let theta = (aqq - app) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..m {
                    let (akp, akq) = (a[k * m + p], a[k * m + q]);
                    a[k * m + p] = c * akp - s * akq;
                    a[k * m + q] = s * akp + c * akq;
                }
                for k in 0..m {
                    let (apk, aqk) = (a[p * m + k], a[q * m + k]);
                    a[p * m + k] = c * apk - s * aqk;
                    a[q * m + k] = s * apk + c * aqk;
                }
                for k in 0..m {
                    let (vkp, vkq) = (v[k * m + p], v[k * m + q]);
                    v[k * m + p] = c * vkp - s * vkq;
                    v[k * m + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..m).collect();
    order.sort_by(|&i, &j| a[j * m + j].total_cmp(&a[i * m + i]).then(i.cmp(&j)));
    let values = order.iter().map(|&i| a[i * m + i]).collect();
    let vectors = order
        .iter()
        .map(|&j| (0..m).map(|k| v[k * m + j]).collect())
        .collect();
    (values, vectors)
}

/// `a (m×m) · q` for `q` given as p columns of length m.
fn mat_cols(a: &[f64], m: usize, q: &[Vec<f64>]) -> Vec<Vec<f64>> {
    q.iter()
        .map(|col| {
            (0..m)
                .map(|i| {
                    a[i * m..(i + 1) * m]
                        .iter()
                        .zip(col)
                        .map(|(x, y)| x * y)
                        .sum()
                })
                .collect()
        })
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Modified Gram–Schmidt; a column that vanishes is replaced by a fresh random one.
fn orthonormalise(cols: &mut [Vec<f64>], rng: &mut SplitMix64) {
    for j in 0..cols.len() {
        for attempt in 0..3 {
            for i in 0..j {
                let (done, rest) = cols.split_at_mut(j);
                let r = dot(&done[i], &rest[0]);
                for (x, y) in rest[0].iter_mut().zip(&done[i]) {
                    *x -= r * y;
                }
            }
            let n = dot(&cols[j], &cols[j]).sqrt();
            if n > 1e-12 || attempt == 2 {
                let n = n.max(f64::MIN_POSITIVE);
                cols[j].iter_mut().for_each(|x| *x /= n);
                break;
            }
            cols[j].iter_mut().for_each(|x| *x = rng.normal());
        }
    }
}

/// Top `k` eigenpairs of the symmetric `m × m` matrix `a`.
pub fn top_eigen(a: &[f64], m: usize, k: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    if m <= 128 {
        let (mut vals, mut vecs) = jacobi_eigen(a, m);
        vals.truncate(k);
        vecs.truncate(k);
        return (vals, vecs);
    }
    let p = (k + 10).min(m);
    let mut rng = SplitMix64::new(0x9CA_5EED);
    let mut q: Vec<Vec<f64>> = (0..p)
        .map(|_| (0..m).map(|_| rng.normal()).collect())
        .collect();
    orthonormalise(&mut q, &mut rng);
    let mut theta = vec![0.0; p];
    for _iter in 0..3000 {
        let z = mat_cols(a, m, &q);
        // Rayleigh–Ritz on span(q): T = qᵀ a q.
        let mut t = vec![0.0; p * p];
        for i in 0..p {
            for j in 0..p {
                t[i * p + j] = dot(&q[i], &z[j]);
            }
        }
        let (vals, w) = jacobi_eigen(&t, p);
        let rotate = |cols: &[Vec<f64>]| -> Vec<Vec<f64>> {
            w.iter()
                .map(|wj| {
                    let mut out = vec![0.0; m];
                    for (c, &coef) in cols.iter().zip(wj) {
                        for (o, x) in out.iter_mut().zip(c) {
                            *o += coef * x;
                        }
                    }
                    out
                })
                .collect()
        };
        q = rotate(&q);
        let mut z = rotate(&z);
        theta = vals;
        let scale = theta[0].abs().max(f64::MIN_POSITIVE);
        let converged = (0..k).all(|j| {
            let r: f64 = z[j]
                .iter()
                .zip(&q[j])
                .map(|(zz, qq)| (zz - theta[j] * qq).powi(2))
                .sum::<f64>()
                .sqrt();
            r <= 1e-9 * scale
        });
        if converged {
            break;
        }
        orthonormalise(&mut z, &mut rng);
        q = z;
    }
    theta.truncate(k);
    q.truncate(k);
    (theta, q)
}

/// Fits a `k`-component PCA to `data` (`n × d` row-major) and projects the rows.
pub fn pca(data: &[f32], n: usize, d: usize, k: usize) -> Result<Pca> {
    if data.len() != n * d {
        return Err(Error::Invalid(format!(
            "PCA: {} values are not {n} rows of {d}",
            data.len()
        )));
    }
    if n < 2 || d == 0 {
        return Err(Error::Invalid(format!(
            "PCA needs at least 2 rows and 1 column, got {n} × {d}"
        )));
    }
    if let Some(i) = data.iter().position(|v| !v.is_finite()) {
        return Err(Error::Invalid(format!(
            "PCA: row {} has a non-finite value (column {})",
            i / d,
            i % d
        )));
    }
    let k = k.min(d).min(n);
    let mut mean = vec![0.0; d];
    for row in data.chunks_exact(d) {
        for (m, &x) in mean.iter_mut().zip(row) {
            *m += x as f64;
        }
    }
    mean.iter_mut().for_each(|m| *m /= n as f64);
    let x: Vec<f64> = data
        .chunks_exact(d)
        .flat_map(|row| row.iter().zip(&mean).map(|(&v, m)| v as f64 - m))
        .collect();
    let denom = (n - 1) as f64;
    let total_variance = x.iter().map(|v| v * v).sum::<f64>() / denom;
    let components: Vec<Vec<f64>>;
    let explained_variance: Vec<f64>;
    if d <= n {
        let mut c = vec![0.0; d * d];
        for row in x.chunks_exact(d) {
            for a in 0..d {
                let xa = row[a];
                if xa == 0.0 {
                    continue;
                }
                for (cc, &xb) in c[a * d + a..(a + 1) * d].iter_mut().zip(&row[a..]) {
                    *cc += xa * xb;
                }
            }
        }
        for a in 0..d {
            for b in a..d {
                let v = c[a * d + b] / denom;
                c[a * d + b] = v;
                c[b * d + a] = v;
            }
        }
        (explained_variance, components) = top_eigen(&c, d, k);
    } else {
        let mut g = vec![0.0; n * n];
        for i in 0..n {
            for j in i..n {
                let v = dot(&x[i * d..(i + 1) * d], &x[j * d..(j + 1) * d]) / denom;
                g[i * n + j] = v;
                g[j * n + i] = v;
            }
        }
        let (vals, us) = top_eigen(&g, n, k);
        components = vals
            .iter()
            .zip(&us)
            .map(|(&lam, u)| {
                let norm = (denom * lam.max(0.0)).sqrt();
                (0..d)
                    .map(|c| {
                        if norm > 0.0 {
                            (0..n).map(|i| x[i * d + c] * u[i]).sum::<f64>() / norm
                        } else {
                            0.0
                        }
                    })
                    .collect()
            })
            .collect();
        explained_variance = vals;
    }
    let components: Vec<Vec<f64>> = components
        .into_iter()
        .map(|mut v| {
            let big = v
                .iter()
                .copied()
                .fold(0.0f64, |m, x| if x.abs() > m.abs() { x } else { m });
            if big < 0.0 {
                v.iter_mut().for_each(|x| *x = -*x);
            }
            v
        })
        .collect();
    let explained_variance = explained_variance.into_iter().map(|v| v.max(0.0)).collect();
    let mut scores = Vec::with_capacity(n * k);
    for row in x.chunks_exact(d) {
        for c in &components {
            scores.push(dot(row, c));
        }
    }
    Ok(Pca {
        mean,
        components,
        explained_variance,
        total_variance,
        scores,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows `u·a·cos φᵢ + v·b·sin φᵢ + offset` with φᵢ = 2πi/n: zero-mean, uncorrelated
    /// coordinates along orthonormal u, v, so the covariance is
    /// `(a²·n/2)/(n−1) · uuᵀ + (b²·n/2)/(n−1) · vvᵀ` exactly.
    fn ellipse(n: usize, d: usize, a: f64, b: f64) -> (Vec<f32>, Vec<f64>, Vec<f64>) {
        let mut u = vec![0.0; d];
        let mut v = vec![0.0; d];
        // u = (e1 + e3)/√2 ... rotated into a few coordinates; v ⟂ u.
        u[1] = 0.6;
        u[d - 1] = 0.8;
        v[0] = 1.0 / 3f64.sqrt();
        v[2] = 1.0 / 3f64.sqrt();
        v[d / 2] = -1.0 / 3f64.sqrt();
        let mut data = Vec::with_capacity(n * d);
        for i in 0..n {
            let phi = 2.0 * std::f64::consts::PI * i as f64 / n as f64;
            for c in 0..d {
                let val = u[c] * a * phi.cos() + v[c] * b * phi.sin() + 0.25 * c as f64;
                data.push(val as f32);
            }
        }
        (data, u, v)
    }

    fn check(n: usize, d: usize) {
        let (a, b) = (3.0, 1.0);
        let (data, u, v) = ellipse(n, d, a, b);
        let p = pca(&data, n, d, 2).unwrap();
        let l1 = a * a * n as f64 / 2.0 / (n - 1) as f64;
        let l2 = b * b * n as f64 / 2.0 / (n - 1) as f64;
        let tol = 1e-4 * l1;
        assert!(
            (p.explained_variance[0] - l1).abs() < tol,
            "{:?} vs {l1}",
            p.explained_variance
        );
        assert!(
            (p.explained_variance[1] - l2).abs() < tol,
            "{:?} vs {l2}",
            p.explained_variance
        );
        assert!((p.total_variance - (l1 + l2)).abs() < tol);
        assert!((p.ratio(0) - 0.9).abs() < 1e-4);
        // Components equal u and v up to sign; the sign rule makes the largest entry positive.
        let (c0, c1) = (&p.components[0], &p.components[1]);
        assert!((dot(c0, &u).abs() - 1.0).abs() < 1e-4, "{}", dot(c0, &u));
        assert!((dot(c1, &v).abs() - 1.0).abs() < 1e-4, "{}", dot(c1, &v));
        assert!(dot(c0, &u) > 0.0, "u's largest entry (0.8) is positive");
        // Scores are the coordinates a·cos φ, b·sin φ (up to the components' signs).
        let s1 = dot(c1, &v).signum();
        for i in 0..n {
            let phi = 2.0 * std::f64::consts::PI * i as f64 / n as f64;
            assert!((p.scores[2 * i] - a * phi.cos()).abs() < 1e-3, "row {i}");
            assert!(
                (p.scores[2 * i + 1] - s1 * b * phi.sin()).abs() < 1e-3,
                "row {i}"
            );
        }
    }

    #[test]
    fn closed_form_covariance_path_jacobi() {
        check(200, 40); // d ≤ n: 40×40 covariance, Jacobi
    }

    #[test]
    fn closed_form_gram_path() {
        check(24, 300); // n < d: 24×24 Gram matrix
    }

    #[test]
    fn closed_form_subspace_iteration() {
        check(400, 200); // 200×200 covariance: subspace iteration
    }

    #[test]
    fn jacobi_on_a_known_matrix() {
        // [[2, 1], [1, 2]]: eigenvalues 3 and 1, eigenvectors (1, 1)/√2 and (1, −1)/√2.
        let (vals, vecs) = jacobi_eigen(&[2.0, 1.0, 1.0, 2.0], 2);
        assert!((vals[0] - 3.0).abs() < 1e-12 && (vals[1] - 1.0).abs() < 1e-12);
        assert!((vecs[0][0].abs() - 0.5f64.sqrt()).abs() < 1e-12);
        assert!((vecs[0][0] - vecs[0][1]).abs() < 1e-12);
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(pca(&[1.0, 2.0], 1, 2, 2).is_err());
        assert!(pca(&[1.0, f32::NAN, 0.0, 1.0], 2, 2, 2).is_err());
        assert!(pca(&[1.0, 2.0, 3.0], 2, 2, 2).is_err());
    }
}
