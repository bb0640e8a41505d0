//! Without the `extension` feature there is nothing to build: the core is pure
//! Rust. With it, the core is still built without torch: torch's side (the C++
//! shim, `cpp/`, and the C++ half of the cxx bridge) is compiled apart, once per
//! torch release, by `build_shim.py`, into a library the package loads at
//! import. This script writes the bridge's generated C++ and everything else
//! that build needs into one folder: `RUSTC10D_SHIM_SOURCES`, or
//! `rustc10d-shim-sources` in the profile's target folder.

fn main() {
    #[cfg(feature = "extension")]
    extension::stage_shim_sources();
}

#[cfg(feature = "extension")]
mod extension {
    use std::fs;
    use std::path::{Path, PathBuf};

    pub fn stage_shim_sources() {
        // Generates the bridge's C++ into OUT_DIR; the shim build compiles it.
        let _ = cxx_build::bridge("src/ffi/mod.rs");
        let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
        let stage = std::env::var_os("RUSTC10D_SHIM_SOURCES").map(PathBuf::from).unwrap_or_else(|| {
            // OUT_DIR is <target>/<profile>/build/rustc10d-<hash>/out.
            out.ancestors().nth(3).expect("OUT_DIR's profile folder").join("rustc10d-shim-sources")
        });
        let cxx_h = PathBuf::from(std::env::var("DEP_CXXBRIDGE1_HEADER").expect("the cxx crate names its header"));
        let cxx_cc = cxx_h.parent().and_then(Path::parent).expect("cxx's crate folder").join("src/cxx.cc");
        let generated = out.join("cxxbridge");
        let copies = [
            (generated.join("sources/rustc10d/src/ffi/mod.rs.cc"), "bridge.cc"),
            (generated.join("include/rustc10d/src/ffi/mod.rs.h"), "include/rustc10d/src/ffi/mod.rs.h"),
            (cxx_h.clone(), "include/rust/cxx.h"),
            // cxx's runtime as its crate lays it out (cxx.cc includes "../include/cxx.h").
            (cxx_h, "cxx/include/cxx.h"),
            (cxx_cc, "cxx/src/cxx.cc"),
        ];
        let ours = fs::read_dir("cpp").expect("cpp/").map(|e| e.expect("cpp/ entry").path());
        let ours: Vec<_> = ours
            .map(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                let to =
                    if name.ends_with(".h") { format!("include/rustc10d/cpp/{name}") } else { format!("cpp/{name}") };
                (p, to)
            })
            .collect();
        for (from, to) in copies.into_iter().map(|(f, t)| (f, t.to_string())).chain(ours) {
            let to = stage.join(to);
            fs::create_dir_all(to.parent().unwrap()).expect("the shim sources folder");
            fs::copy(&from, &to)
                .unwrap_or_else(|e| panic!("rustc10d: copying {} to {}: {e}", from.display(), to.display()));
        }
        println!("cargo:rerun-if-changed=cpp");
        println!("cargo:rerun-if-changed=src/ffi/mod.rs");
        println!("cargo:rerun-if-env-changed=RUSTC10D_SHIM_SOURCES");
    }
}
