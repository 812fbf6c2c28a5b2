//! Symmetric eigenproblems for PCA: complete diagonalisation by cyclic Jacobi rotations for a
//! small matrix, the top few eigenpairs by block Krylov iteration for a large one (given as a
//! product, so that it need not be formed).

use crate::rng::SplitMix64;

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
        .map(|col| a.chunks_exact(m).map(|row| dot(row, col)).collect())
        .collect()
}

/// Dot product with four running sums, so that the compiler vectorises it (one sum in order
/// cannot be reordered into SIMD lanes).
pub(super) fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut s = [0.0f64; 4];
    let (ac, bc) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..4 {
            s[l] += x[l] * y[l];
        }
    }
    (s[0] + s[1]) + (s[2] + s[3]) + tail
}

pub(super) fn axpy(out: &mut [f64], a: f64, x: &[f64]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// Orthonormalises `block` against the orthonormal `basis` and against itself (Gram–Schmidt,
/// twice, which keeps it orthogonal to working precision). A column left with less than 1e-10
/// of its norm lies in the span already and is dropped: in a Krylov basis that means the span
/// is an invariant subspace.
fn orthonormalise_against(basis: &[Vec<f64>], block: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
    let mut kept: Vec<Vec<f64>> = Vec::with_capacity(block.len());
    for mut col in block {
        let before = dot(&col, &col).sqrt();
        if before == 0.0 || !before.is_finite() {
            continue;
        }
        for _pass in 0..2 {
            for b in basis.iter().chain(&kept) {
                let r = dot(b, &col);
                axpy(&mut col, -r, b);
            }
        }
        let after = dot(&col, &col).sqrt();
        if after > 1e-10 * before {
            col.iter_mut().for_each(|x| *x /= after);
            kept.push(col);
        }
    }
    kept
}

/// `Σ_l s_l · cols_l`.
fn combine(cols: &[Vec<f64>], s: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; cols[0].len()];
    for (c, &coef) in cols.iter().zip(s) {
        axpy(&mut out, coef, c);
    }
    out
}

/// A symmetric operator applied to a block of columns.
pub type Product<'a> = dyn Fn(&[Vec<f64>]) -> Vec<Vec<f64>> + 'a;

/// Relative residual `‖Ay − θy‖ / |θ₁|` at which a Ritz pair counts as converged: far below
/// what a plot or a printed share of variance can show, and reached in a few blocks where the
/// spectrum decays as embeddings' do.
const TOLERANCE: f64 = 1e-7;
/// Operator applications (blocks) after which the best Ritz pairs are returned as they are.
/// Only a nearly flat spectrum (noise) gets here, where the leading directions are ill-defined
/// and any vectors of the near-degenerate cluster serve the plot equally.
const MAX_BLOCKS: usize = 150;

/// Top `k` eigenpairs of a symmetric positive semi-definite operator of order `m` given by
/// `apply` (A times a block of columns): block Krylov iteration with Rayleigh–Ritz and thick
/// restarts, from a fixed seed. A block of k + 8 vectors finds eigenvalues of multiplicity up
/// to that, and the Krylov space converges with the square root of the eigengap ratio that
/// plain subspace iteration depends on (on 3000 × 3000 noise that was 2,000 iterations).
pub fn top_eigen_krylov(apply: &Product, m: usize, k: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    let k = k.min(m);
    let p = (k + 8).min(m);
    // Basis size at which the search restarts from its best Ritz vectors: Rayleigh–Ritz costs
    // cap³ per step, the basis cap·m memory.
    let cap = (16 * p).min(m);
    let mut rng = SplitMix64::new(0x9CA_5EED);
    let start: Vec<Vec<f64>> = (0..p)
        .map(|_| (0..m).map(|_| rng.normal()).collect())
        .collect();
    let mut basis: Vec<Vec<f64>> = Vec::new();
    let mut images: Vec<Vec<f64>> = Vec::new();
    let mut block = start;
    let mut since_ritz = 0;
    for blocks in 1..=MAX_BLOCKS {
        let fresh = orthonormalise_against(&basis, block);
        let invariant = fresh.is_empty();
        if !invariant {
            let img = apply(&fresh);
            basis.extend(fresh);
            images.extend(img.iter().cloned());
            block = img;
        } else {
            block = Vec::new();
        }
        since_ritz += 1;
        let full = basis.len() >= m;
        let restart = basis.len() + p > cap;
        let last = blocks == MAX_BLOCKS;
        if basis.len() < k || !(invariant || full || restart || last || since_ritz >= 2) {
            continue;
        }
        since_ritz = 0;
        // Rayleigh–Ritz on span(basis): T = basisᵀ A basis, symmetrised.
        let l = basis.len();
        let mut t = vec![0.0; l * l];
        for i in 0..l {
            for j in i..l {
                let v = 0.5 * (dot(&basis[i], &images[j]) + dot(&basis[j], &images[i]));
                t[i * l + j] = v;
                t[j * l + i] = v;
            }
        }
        let (theta, s) = jacobi_eigen(&t, l);
        let keep = if restart { (2 * p).min(l) } else { k };
        let ritz: Vec<Vec<f64>> = s[..keep].iter().map(|sj| combine(&basis, sj)).collect();
        let ritz_img: Vec<Vec<f64>> = s[..keep].iter().map(|sj| combine(&images, sj)).collect();
        let scale = theta[0].abs().max(f64::MIN_POSITIVE);
        let converged = (0..k).all(|j| {
            let r: f64 = ritz_img[j]
                .iter()
                .zip(&ritz[j])
                .map(|(a, y)| (a - theta[j] * y).powi(2))
                .sum::<f64>()
                .sqrt();
            r <= TOLERANCE * scale
        });
        if converged || invariant || full || last {
            let mut vecs = ritz;
            vecs.truncate(k);
            return (theta[..k].to_vec(), vecs);
        }
        if restart {
            // Keep the best 2p Ritz pairs (A·y is known exactly as a combination of the
            // images) and continue the Krylov space from the top p's images.
            block = ritz_img[..p].to_vec();
            basis = ritz;
            images = ritz_img;
        }
    }
    unreachable!("the last block returns")
}

/// The top `k` eigenpairs of the symmetric `m × m` matrix `a`: all of them by Jacobi for a
/// small matrix, else by block Krylov iteration.
pub fn top_eigen(a: &[f64], m: usize, k: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    if m <= 128 {
        let (mut vals, mut vecs) = jacobi_eigen(a, m);
        vals.truncate(k);
        vecs.truncate(k);
        return (vals, vecs);
    }
    top_eigen_krylov(&|q| mat_cols(a, m, q), m, k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jacobi_on_a_known_matrix() {
        // [[2, 1], [1, 2]]: eigenvalues 3 and 1, eigenvectors (1, 1)/√2 and (1, −1)/√2.
        let (vals, vecs) = jacobi_eigen(&[2.0, 1.0, 1.0, 2.0], 2);
        assert!((vals[0] - 3.0).abs() < 1e-12 && (vals[1] - 1.0).abs() < 1e-12);
        assert!((vecs[0][0].abs() - 0.5f64.sqrt()).abs() < 1e-12);
        assert!((vecs[0][0] - vecs[0][1]).abs() < 1e-12);
    }

    /// Full-rank data of a slowly decaying spectrum (the hard case for iteration): the Krylov
    /// path's top eigenpairs equal a complete Jacobi diagonalisation of the same matrix.
    #[test]
    fn krylov_matches_jacobi_on_a_full_rank_matrix() {
        let m = 160;
        let mut rng = SplitMix64::new(5);
        let rows = 400;
        let x: Vec<f64> = (0..rows * m)
            .map(|i| rng.normal() * (1.0 + (i % m) as f64).powf(-0.3))
            .collect();
        let mut a = vec![0.0; m * m];
        for row in x.chunks_exact(m) {
            for i in 0..m {
                for j in 0..m {
                    a[i * m + j] += row[i] * row[j];
                }
            }
        }
        let (jv, jw) = jacobi_eigen(&a, m);
        let (kv, kw) = top_eigen(&a, m, 2);
        for j in 0..2 {
            assert!(
                (kv[j] - jv[j]).abs() < 1e-9 * jv[0],
                "λ{j}: {} vs {}",
                kv[j],
                jv[j]
            );
            // The gap to the next eigenvalue bounds the angle: residual ≤ 1e-7·λ₁.
            let gap = (jv[j] - jv[j + 1]).min(if j > 0 { jv[j - 1] - jv[j] } else { f64::MAX });
            let tol = 2e-7 * jv[0] / gap;
            assert!((dot(&kw[j], &jw[j]).abs() - 1.0).abs() < tol, "vector {j}");
        }
    }
}
