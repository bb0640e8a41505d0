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

        let mut b = cxx_build::bridge("src/ffi.rs");
        b.file("cpp/shim.cc")
            .std("c++20")
            .include(py_include)
            .define("TORCH_API_INCLUDE_EXTENSION_H", None)
            .define("_GLIBCXX_USE_CXX11_ABI", abi)
            .flag("-fvisibility=hidden")
            .flag_if_supported("-Wno-unused-parameter")
            .flag_if_supported("-Wno-deprecated-declarations");
        for inc in includes.split('|') {
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

        println!("cargo:rerun-if-changed=cpp/shim.cc");
        println!("cargo:rerun-if-changed=cpp/shim.h");
        println!("cargo:rerun-if-changed={torch_file}");
        println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
        println!("cargo:rerun-if-env-changed=PYTHON_SYS_EXECUTABLE");
    }
}
