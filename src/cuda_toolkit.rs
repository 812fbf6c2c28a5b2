//! What `--backend cuda` needs on the machine besides the driver, looked for the way cubecl
//! and cudarc will look for it, so that a missing piece is an error naming what is missing
//! and where it was looked for — before any work. Left to cubecl, the first kernel that needs
//! it fails (libdevice) or the process panics inside cubecl (no toolkit for NVRTC).
//!
//! - The default build compiles kernels through LLVM to PTX (cubecl-llvm). A kernel calling
//!   exp, log or tanh links `libdevice.10.bc`, which cubecl-llvm reads from
//!   `$CUDA_PATH/nvvm/libdevice/` when `CUDA_PATH` is set (there only), else from the first of
//!   [`TOOLKIT_ROOTS`] that has an `nvvm/libdevice` directory.
//! - The `cuda-nvrtc` build hands CUDA C++ to NVRTC (cudarc dlopens `libnvrtc.so`, `.so.12`,
//!   ...; CUDA 13's `libnvrtc.so.13` only through an unversioned link) with the toolkit's
//!   `include/` on its path; cubecl-cuda takes the toolkit from `CUDA_PATH`, else
//!   /usr/local/cuda, /opt/cuda, or /usr when /usr/bin/nvcc exists, and panics without one.
//!
//! `scripts/gpu-env.sh` sets `CUDA_PATH` and the links on a GPU machine (docs/GPU.md).

use std::path::{Path, PathBuf};

/// Where cubecl-llvm looks for a toolkit when `CUDA_PATH` is unset, in its order.
pub const TOOLKIT_ROOTS: [&str; 4] = ["/usr/local/cuda", "/opt/cuda", "/usr/lib/cuda", "/usr"];

/// How this build turns CubeCL kernels into PTX.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelCompiler {
    /// cubecl-llvm: LLVM's NVPTX back end, in the process.
    Llvm,
    /// cubecl-cpp: CUDA C++ compiled by NVRTC (feature `cuda-nvrtc`).
    Nvrtc,
}

impl KernelCompiler {
    pub fn of_this_build() -> Self {
        if cfg!(feature = "cuda-nvrtc") {
            KernelCompiler::Nvrtc
        } else {
            KernelCompiler::Llvm
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KernelCompiler::Llvm => "LLVM (NVPTX)",
            KernelCompiler::Nvrtc => "NVRTC",
        }
    }
}

const FIX: &str = "install a CUDA toolkit, set CUDA_PATH to one, or `source scripts/gpu-env.sh` \
                   (docs/GPU.md), which also finds the copies inside Python's nvidia/triton wheels";

/// The libdevice file cubecl-llvm will link, or an error listing every place it would look.
/// `cuda_path` is `CUDA_PATH`; `root` prefixes every absolute path (tests use a fake tree;
/// a real run passes "/").
pub fn libdevice(cuda_path: Option<&str>, root: &Path) -> Result<PathBuf, String> {
    let rel = Path::new("nvvm/libdevice/libdevice.10.bc");
    let at = |p: &str| root.join(p.trim_start_matches('/'));
    let looked: Vec<String> = match cuda_path {
        // cubecl-llvm takes CUDA_PATH as the toolkit without checking it, so nothing else is
        // looked at when it is set.
        Some(p) => {
            let file = at(p).join(rel);
            if file.is_file() {
                return Ok(file);
            }
            vec![format!(
                "{} (CUDA_PATH={p})",
                Path::new(p).join(rel).display()
            )]
        }
        None => {
            for r in TOOLKIT_ROOTS {
                // The first root with the directory is the one used, file or not.
                if at(r).join("nvvm/libdevice").is_dir() {
                    let file = at(r).join(rel);
                    return if file.is_file() {
                        Ok(file)
                    } else {
                        Err(format!(
                            "--backend cuda: the kernel compiler (LLVM) needs libdevice.10.bc, \
                             which is missing from {r}/nvvm/libdevice; {FIX}"
                        ))
                    };
                }
            }
            let mut l = vec!["CUDA_PATH (unset)".to_string()];
            l.extend(TOOLKIT_ROOTS.iter().map(|r| format!("{r}/nvvm/libdevice")));
            l
        }
    };
    Err(format!(
        "--backend cuda: the kernel compiler (LLVM) needs libdevice.10.bc from a CUDA toolkit \
         for exp/log/tanh; looked in {}; {FIX}",
        looked.join(", ")
    ))
}

/// The include directory cubecl-cuda hands NVRTC, or an error saying where it looked.
pub fn nvrtc_include(cuda_path: Option<&str>, root: &Path) -> Result<PathBuf, String> {
    let at = |p: &str| root.join(p.trim_start_matches('/'));
    let toolkit = match cuda_path {
        Some(p) => Some(p.to_string()),
        None => ["/usr/local/cuda", "/opt/cuda"]
            .into_iter()
            .find(|r| at(r).exists())
            .map(str::to_string)
            .or_else(|| at("/usr/bin/nvcc").exists().then(|| "/usr".to_string())),
    };
    let Some(t) = toolkit else {
        return Err(format!(
            "--backend cuda: the NVRTC kernel compiler needs a CUDA toolkit's headers; looked \
             at CUDA_PATH (unset), /usr/local/cuda, /opt/cuda, /usr/bin/nvcc; {FIX}"
        ));
    };
    let inc = at(&t).join("include");
    if inc.is_dir() {
        Ok(inc)
    } else {
        Err(format!(
            "--backend cuda: the NVRTC kernel compiler needs {t}/include (the CUDA toolkit's \
             headers), which does not exist; {FIX}"
        ))
    }
}

/// Everything this build's kernel compiler needs, checked on this machine.
#[cfg(feature = "cuda")]
pub fn preflight() -> crate::error::Result<()> {
    use crate::error::Error;
    let cuda_path = std::env::var("CUDA_PATH").ok();
    let root = Path::new("/");
    match KernelCompiler::of_this_build() {
        KernelCompiler::Llvm => libdevice(cuda_path.as_deref(), root).map(drop),
        KernelCompiler::Nvrtc => {
            // SAFETY: only tries to dlopen the library.
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err(Error::Invalid(format!(
                    "--backend cuda: this build compiles kernels with NVRTC, but libnvrtc was \
                     not found on the library path (tried libnvrtc.so, .so.12, .so.11, ...: \
                     CUDA 13's libnvrtc.so.13 needs an unversioned libnvrtc.so link); {FIX}"
                )));
            }
            nvrtc_include(cuda_path.as_deref(), root).map(drop)
        }
    }
    .map_err(Error::Invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(root: &Path, p: &str) {
        let f = root.join(p);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, b"x").unwrap();
    }

    #[test]
    fn libdevice_is_found_where_cubecl_llvm_reads_it() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        // Nothing anywhere: every place is named.
        let e = libdevice(None, r).unwrap_err();
        for place in [
            "CUDA_PATH",
            "/usr/local/cuda/nvvm",
            "/opt/cuda/nvvm",
            "/usr/nvvm",
        ] {
            assert!(e.contains(place), "{e}");
        }
        // The second root is used when the first has no nvvm/libdevice.
        touch(r, "opt/cuda/nvvm/libdevice/libdevice.10.bc");
        assert_eq!(
            libdevice(None, r).unwrap(),
            r.join("opt/cuda/nvvm/libdevice/libdevice.10.bc")
        );
        // An earlier root with the directory but no file shadows later ones, as in cubecl.
        std::fs::create_dir_all(r.join("usr/local/cuda/nvvm/libdevice")).unwrap();
        let e = libdevice(None, r).unwrap_err();
        assert!(
            e.contains("missing from /usr/local/cuda/nvvm/libdevice"),
            "{e}"
        );
        // CUDA_PATH is the only place looked at when set, even when a root has the file.
        let e = libdevice(Some("/elsewhere"), r).unwrap_err();
        assert!(e.contains("/elsewhere/nvvm/libdevice/libdevice.10.bc (CUDA_PATH=/elsewhere)"));
        assert!(!e.contains("/opt/cuda"), "{e}");
        touch(r, "elsewhere/nvvm/libdevice/libdevice.10.bc");
        assert!(libdevice(Some("/elsewhere"), r).is_ok());
    }

    #[test]
    fn nvrtc_needs_a_toolkit_include_directory() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        let e = nvrtc_include(None, r).unwrap_err();
        assert!(e.contains("/usr/bin/nvcc"), "{e}");
        // nvcc in /usr/bin makes /usr the toolkit, as cubecl-cuda decides.
        touch(r, "usr/bin/nvcc");
        let e = nvrtc_include(None, r).unwrap_err();
        assert!(e.contains("/usr/include"), "{e}");
        std::fs::create_dir_all(r.join("usr/include")).unwrap();
        assert_eq!(nvrtc_include(None, r).unwrap(), r.join("usr/include"));
        // /usr/local/cuda comes first once it exists.
        std::fs::create_dir_all(r.join("usr/local/cuda/include")).unwrap();
        assert_eq!(
            nvrtc_include(None, r).unwrap(),
            r.join("usr/local/cuda/include")
        );
        assert!(nvrtc_include(Some("/nowhere"), r).is_err());
    }
}
