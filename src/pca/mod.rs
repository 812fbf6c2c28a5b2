//! Principal component analysis for embedding plots: small, deterministic, dependency-free.
//!
//! The data are centred; the eigenvectors of the sample covariance `XᵀX/(n−1)` (d×d) are found,
//! or, when there are fewer rows than columns, those of the Gram matrix `XXᵀ/(n−1)` (n×n, the
//! same non-zero eigenvalues; components are mapped back with `v = Xᵀu / √((n−1)λ)`). A matrix
//! of order ≤ 128 is diagonalised completely with cyclic Jacobi rotations; a larger one by block
//! Krylov iteration (k + 8 vectors per block, Rayleigh–Ritz with Jacobi, thick restarts, from a
//! fixed seed) until the top k residuals are below 1e-7 of the largest eigenvalue. Past order
//! 512 the matrix is never formed: it is applied through the data (`Xᵀ(XW)`), which for a 25B
//! model's 8,192-wide embeddings is the difference between seconds and many minutes and half a
//! GiB. Each component's sign is fixed so that its largest-magnitude coordinate is positive, so
//! results are reproducible.

mod eigen;

use crate::error::{Error, Result};
use eigen::{axpy, dot};
pub use eigen::{jacobi_eigen, top_eigen, top_eigen_krylov};

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

/// Rows of the centred data per parallel task in the implicit products.
const ROWS_PER_TASK: usize = 64;

/// `XᵀX·W/(n−1)` for d-long columns W, without forming the covariance: one pass over the rows,
/// each row's p dot products then p updates while it is in cache.
fn covariance_apply(x: &[f64], d: usize, denom: f64, w: &[Vec<f64>]) -> Vec<Vec<f64>> {
    use rayon::prelude::*;
    let zero = || vec![vec![0.0; d]; w.len()];
    let mut out = x
        .par_chunks(ROWS_PER_TASK * d)
        .fold(zero, |mut acc, rows| {
            for row in rows.chunks_exact(d) {
                for (a, col) in acc.iter_mut().zip(w) {
                    axpy(a, dot(row, col), row);
                }
            }
            acc
        })
        .reduce(zero, |mut a, b| {
            for (x, y) in a.iter_mut().zip(&b) {
                axpy(x, 1.0, y);
            }
            a
        });
    out.iter_mut().flatten().for_each(|v| *v /= denom);
    out
}

/// `XXᵀ·U/(n−1)` for n-long columns U, without forming the Gram matrix: `V = XᵀU` (p vectors
/// of length d), then each row's dot products with V.
fn gram_apply(x: &[f64], d: usize, denom: f64, u: &[Vec<f64>]) -> Vec<Vec<f64>> {
    use rayon::prelude::*;
    let zero = || vec![vec![0.0; d]; u.len()];
    let v = x
        .par_chunks(ROWS_PER_TASK * d)
        .enumerate()
        .fold(zero, |mut acc, (t, rows)| {
            for (r, row) in rows.chunks_exact(d).enumerate() {
                let i = t * ROWS_PER_TASK + r;
                for (a, col) in acc.iter_mut().zip(u) {
                    axpy(a, col[i], row);
                }
            }
            acc
        })
        .reduce(zero, |mut a, b| {
            for (x, y) in a.iter_mut().zip(&b) {
                axpy(x, 1.0, y);
            }
            a
        });
    v.iter()
        .map(|vj| {
            x.par_chunks(d)
                .map(|row| dot(row, vj) / denom)
                .collect::<Vec<f64>>()
        })
        .collect()
}

/// Order up to which the covariance or Gram matrix is formed (n·m² work, then m² per product):
/// past it, applying it through the data (2·n·d per product) is cheaper than forming it.
const FORMED_MAX: usize = 512;

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
    // Fallibly: n·d f64 of a wide file did not fit and aborted the process.
    let mut x: Vec<f64> = Vec::new();
    x.try_reserve_exact(n * d).map_err(|_| {
        Error::Invalid(format!(
            "PCA: {n} rows of {d} dimensions as f64 ({} MiB) do not fit in memory",
            (n * d * 8) >> 20
        ))
    })?;
    x.extend(
        data.chunks_exact(d)
            .flat_map(|row| row.iter().zip(&mean).map(|(&v, m)| v as f64 - m)),
    );
    let denom = (n - 1) as f64;
    let total_variance = x.iter().map(|v| v * v).sum::<f64>() / denom;
    // The eigenproblem is solved on the smaller side: the d×d covariance, or the n×n Gram
    // matrix with the same non-zero eigenvalues.
    let covariance_side = d <= n;
    let m = d.min(n);
    let (vals, vecs) = if m <= FORMED_MAX {
        let mut a = vec![0.0; m * m];
        if covariance_side {
            for row in x.chunks_exact(d) {
                for i in 0..d {
                    let xi = row[i];
                    if xi != 0.0 {
                        axpy(&mut a[i * d + i..(i + 1) * d], xi, &row[i..]);
                    }
                }
            }
        } else {
            for i in 0..n {
                for j in i..n {
                    a[i * n + j] = dot(&x[i * d..(i + 1) * d], &x[j * d..(j + 1) * d]);
                }
            }
        }
        for i in 0..m {
            for j in i..m {
                let v = a[i * m + j] / denom;
                a[i * m + j] = v;
                a[j * m + i] = v;
            }
        }
        top_eigen(&a, m, k)
    } else if covariance_side {
        top_eigen_krylov(&|w| covariance_apply(&x, d, denom, w), m, k)
    } else {
        top_eigen_krylov(&|u| gram_apply(&x, d, denom, u), m, k)
    };
    let components: Vec<Vec<f64>> = if covariance_side {
        vecs
    } else {
        // v = Xᵀu / √((n−1)λ): the unit right singular vector of the left one u.
        vals.iter()
            .zip(&vecs)
            .map(|(&lam, u)| {
                let norm = (denom * lam.max(0.0)).sqrt();
                let mut v = vec![0.0; d];
                if norm > 0.0 {
                    for (row, &ui) in x.chunks_exact(d).zip(u) {
                        axpy(&mut v, ui / norm, row);
                    }
                }
                v
            })
            .collect()
    };
    let explained_variance = vals;
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
    use crate::rng::SplitMix64;

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
    fn closed_form_krylov_on_a_formed_matrix() {
        check(400, 200); // 200×200 covariance, formed: block Krylov
    }

    /// `r` orthonormal columns of length `len` (row-major `len × r`), each orthogonal to the
    /// all-ones vector when `centred`, so that data built from them need no centring.
    fn orthonormal(len: usize, r: usize, centred: bool, seed: u64) -> Vec<Vec<f64>> {
        let mut rng = SplitMix64::new(seed);
        let mut cols: Vec<Vec<f64>> = Vec::new();
        let ones = vec![1.0 / (len as f64).sqrt(); len];
        while cols.len() < r {
            let mut c: Vec<f64> = (0..len).map(|_| rng.normal()).collect();
            for _ in 0..2 {
                for b in cols.iter().chain(centred.then_some(&ones)) {
                    let t: f64 = b.iter().zip(&c).map(|(x, y)| x * y).sum();
                    c.iter_mut().zip(b).for_each(|(x, y)| *x -= t * y);
                }
            }
            let norm = c.iter().map(|x| x * x).sum::<f64>().sqrt();
            c.iter_mut().for_each(|x| *x /= norm);
            cols.push(c);
        }
        cols
    }

    /// Data `U·diag(σ)·Vᵀ + offset` with centred orthonormal U (n × r) and orthonormal V
    /// (d × r): the covariance's eigenpairs are exactly `σᵢ²/(n−1)` and the columns of V.
    fn known_spectrum(n: usize, d: usize, sigma: &[f64]) -> (Vec<f32>, Vec<Vec<f64>>) {
        let u = orthonormal(n, sigma.len(), true, 11);
        let v = orthonormal(d, sigma.len(), false, 12);
        let mut data = vec![0.0f32; n * d];
        for i in 0..n {
            for c in 0..d {
                let x: f64 = (0..sigma.len()).map(|j| u[j][i] * sigma[j] * v[j][c]).sum();
                data[i * d + c] = (x + 0.5 + 0.01 * c as f64) as f32;
            }
        }
        (data, v)
    }

    /// Largest |cos| between `c` and the span of `basis` (orthonormal).
    fn in_span(c: &[f64], basis: &[&Vec<f64>]) -> f64 {
        basis.iter().map(|b| dot(c, b).powi(2)).sum::<f64>().sqrt()
    }

    /// Past order 512 the covariance (d ≤ n) or the Gram matrix (n < d) is applied through the
    /// data, never formed; both find the closed-form eigenpairs of a 30-term spectrum.
    #[test]
    fn implicit_products_find_a_known_spectrum() {
        let sigma: Vec<f64> = (0..30).map(|j| 40.0 * 0.8f64.powi(j)).collect();
        for (n, d) in [(700, 600), (530, 900)] {
            let (data, v) = known_spectrum(n, d, &sigma);
            let p = pca(&data, n, d, 2).unwrap();
            for j in 0..2 {
                let want = sigma[j] * sigma[j] / (n - 1) as f64;
                let got = p.explained_variance[j];
                // The data are rounded to f32 (relative 6e-8 of values up to ~9).
                assert!(
                    (got - want).abs() < 1e-5 * want,
                    "{n}×{d} λ{j}: {got} vs {want}"
                );
                let cos = dot(&p.components[j], &v[j]).abs();
                assert!(
                    (cos - 1.0).abs() < 1e-6,
                    "{n}×{d} component {j}: |cos| {cos}"
                );
            }
        }
    }

    /// A doubled top eigenvalue (a circle in the top plane): both components lie in its plane
    /// and share its variance, which a single-vector Krylov method would miss.
    #[test]
    fn a_repeated_eigenvalue_gives_both_components() {
        let sigma = [20.0, 20.0, 5.0, 4.0, 3.0, 2.0, 1.0];
        let (n, d) = (600, 560);
        let (data, v) = known_spectrum(n, d, &sigma);
        let p = pca(&data, n, d, 2).unwrap();
        let want = 400.0 / (n - 1) as f64;
        for j in 0..2 {
            assert!((p.explained_variance[j] - want).abs() < 1e-5 * want);
            let cos = in_span(&p.components[j], &[&v[0], &v[1]]);
            assert!(
                (cos - 1.0).abs() < 1e-6,
                "component {j} leaves the plane: {cos}"
            );
        }
        assert!(dot(&p.components[0], &p.components[1]).abs() < 1e-6);
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(pca(&[1.0, 2.0], 1, 2, 2).is_err());
        assert!(pca(&[1.0, f32::NAN, 0.0, 1.0], 2, 2, 2).is_err());
        assert!(pca(&[1.0, 2.0, 3.0], 2, 2, 2).is_err());
    }
}
