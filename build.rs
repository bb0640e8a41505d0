//! Without the `extension` feature there is nothing to build: the core is pure
//! Rust. With it, ask the Python that builds us for its torch (version, C++ ABI,
//! headers, libraries) and compile the C++ shim exactly as torch's own
//! cpp_extension would, then link torch and record its version.

fn main() {
    #[cfg(feature = "extension")]
    extension::build();
}

#[cfg(feature = "extension")]
mod extension {
    use std::process::Command;

    const PROBE: &str = r#"
import sys, sysconfig
try:
    import torch, torch.utils.cpp_extension as ext
except Exception as e:
    sys.exit(f"import torch failed: {e}")
print(torch.__version__)
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__file__)
print(sysconfig.get_paths()["include"])
print("|".join(ext.include_paths()))
print("|".join(ext.library_paths()))
"#;

    pub fn build() {
        let python = std::env::var("PYO3_PYTHON")
            .or_else(|_| std::env::var("PYTHON_SYS_EXECUTABLE"))
            .unwrap_or_else(|_| "python3".into());
        let out = Command::new(&python).args(["-c", PROBE]).output().unwrap_or_else(|e| {
            panic!("rustc10d: could not run {python}: {e}. Set PYO3_PYTHON to the Python that has torch installed.")
        });
        if !out.status.success() {
            panic!(
                "rustc10d: {python} has no usable torch ({}). Install torch into that environment first \
                 (pip install torch), then build with `pip install --no-build-isolation .`",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let text = String::from_utf8(out.stdout).expect("utf-8 probe output");
        let lines: Vec<&str> = text.lines().collect();
        let [version, abi, torch_file, py_include, includes, libs] = lines[..] else {
            panic!("rustc10d: unexpected torch probe output: {text}");
        };

        let mut b = cxx_build::bridge("src/ffi/mod.rs");
        let include_dirs: Vec<&str> = includes.split('|').collect();
        let mut features = Vec::new();
        for (feature, has) in probe_torch_features(&include_dirs) {
            let bit = if has { "1" } else { "0" };
            b.define(&format!("RUSTC10D_TORCH_HAS_{feature}"), bit);
            features.push(format!("{}={bit}", feature.to_ascii_lowercase()));
        }
        b.files(["cpp/backend.cc", "cpp/completion.cc"])
            .std("c++20")
            .include(py_include)
            .define("TORCH_API_INCLUDE_EXTENSION_H", None)
            .define("_GLIBCXX_USE_CXX11_ABI", abi)
            .flag("-fvisibility=hidden")
            .flag_if_supported("-Wno-unused-parameter")
            .flag_if_supported("-Wno-deprecated-declarations");
        for inc in &include_dirs {
            b.include(inc);
        }
        b.compile("rustc10d_shim");

        for lib in libs.split('|') {
            println!("cargo:rustc-link-search=native={lib}");
        }
        for lib in ["c10", "torch_cpu", "torch_python"] {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }
        // Installed next to torch: find its libraries relative to us first, then
        // where they were at build time (editable installs, other layouts).
        println!("cargo:rustc-cdylib-link-arg=-Wl,--enable-new-dtags");
        println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib");
        let libdir = libs.split('|').next().unwrap_or_default();
        println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,{libdir}");
        println!("cargo:rustc-env=RUSTC10D_TORCH_VERSION={version}");
        println!("cargo:rustc-env=RUSTC10D_TORCH_FEATURES={}", features.join(","));

        println!("cargo:rerun-if-changed=cpp");
        println!("cargo:rerun-if-changed={torch_file}");
        println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
        println!("cargo:rerun-if-env-changed=PYTHON_SYS_EXECUTABLE");
    }

    /// The torch APIs that differ across the supported releases (2.11 to
    /// 2.15): (feature, header under torch/csrc/distributed/c10d, an
    /// identifier only that feature declares there). cpp/torch_compat.h turns
    /// each RUSTC10D_TORCH_HAS_<feature> into what the shim uses.
    const TORCH_FEATURES: [(&str, &str, &str); 6] = [
        // Backend::registerCompletionHook and friends (2.15).
        ("COMPLETION_HOOKS", "Backend.hpp", "registerCompletionHook"),
        // Work::getCompletionKey (2.15).
        ("COMPLETION_KEY", "Work.hpp", "getCompletionKey"),
        // c10d::PreMulSumSupplement; before, NCCLPreMulSumSupplement.
        ("PREMUL_SUM_SUPPLEMENT", "Types.hpp", "PreMulSumSupplement"),
        // OpType::ALLGATHER_INTO_TENSOR_COALESCED and its reduce-scatter twin.
        ("TENSOR_COALESCED_OPTYPES", "Work.hpp", "ALLGATHER_INTO_TENSOR_COALESCED"),
        // Backend::gather_into_tensor.
        ("GATHER_INTO_TENSOR", "Backend.hpp", "gather_into_tensor"),
        // Backend::supportsReconfigure, get_reconfigure_handle, reconfigure (2.15).
        ("RECONFIGURE", "Backend.hpp", "get_reconfigure_handle"),
    ];

    /// Which of TORCH_FEATURES the torch headers in `include_dirs` declare.
    /// Reading the headers is instant, where a compile per probe would cost
    /// seconds of torch headers each.
    fn probe_torch_features(include_dirs: &[&str]) -> Vec<(&'static str, bool)> {
        TORCH_FEATURES
            .iter()
            .map(|&(feature, header, ident)| {
                let text = include_dirs
                    .iter()
                    .map(|dir| std::path::Path::new(dir).join("torch/csrc/distributed/c10d").join(header))
                    .find_map(|path| std::fs::read_to_string(path).ok())
                    .unwrap_or_else(|| panic!("rustc10d: torch has no c10d header {header}; is this a torch built with distributed support?"));
                (feature, declares(&text, ident))
            })
            .collect()
    }

    /// Whether `ident` occurs in `text` as a whole identifier (not inside a
    /// longer one: `gather_into_tensor` is not `allgather_into_tensor`).
    fn declares(text: &str, ident: &str) -> bool {
        let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        text.match_indices(ident).any(|(at, _)| {
            let before = text[..at].chars().next_back();
            let after = text[at + ident.len()..].chars().next();
            !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
        })
    }
}
