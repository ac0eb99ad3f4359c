//! Builds the BPF programs in `../ebpf` (for `bpfel-unknown-none`, with the nightly
//! toolchain pinned in `../ebpf/rust-toolchain.toml` and bpf-linker) into
//! `OUT_DIR/shareguard-ebpf`, which `src/bpf.rs` embeds.
//!
//! `ebpf/` is not part of the host workspace, so this script is the only thing that builds
//! it: `cargo build` from the repository root is enough once the toolchain is installed.
//! aya-build runs a nested `cargo +<that nightly> build` from the current directory, which is
//! why the script changes into `ebpf/` first (the package is not in this workspace).

use std::{
    env,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

/// Package and binary name in ebpf/Cargo.toml; the object lands at OUT_DIR/<this>.
const EBPF_PACKAGE: &str = "shareguard-ebpf";
const INSTALL_HINT: &str = "run scripts/test.sh or `make test`, which install them \
     (ensure_bpf_toolchain in scripts/lib.sh)";

fn main() -> ExitCode {
    match build() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: building the BPF programs in ebpf/ failed: {message}");
            ExitCode::FAILURE
        }
    }
}

fn build() -> Result<(), String> {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR not set")?);
    let root = manifest_dir
        .parent()
        .ok_or("limiter-net has no parent directory")?;
    let ebpf_dir = root.join("ebpf");
    let common_dir = root.join("ebpf-common");

    // aya-build watches ebpf/ itself; the shared types live in a crate it does not know of.
    for path in [common_dir.join("src"), common_dir.join("Cargo.toml")] {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    println!("cargo:rerun-if-env-changed=PATH");

    let toolchain_file = ebpf_dir.join("rust-toolchain.toml");
    println!("cargo:rerun-if-changed={}", toolchain_file.display());
    let nightly = pinned_channel(&toolchain_file)?;
    check_toolchain(&nightly)?;

    let ebpf_dir_str = ebpf_dir
        .to_str()
        .ok_or_else(|| format!("path {} is not UTF-8", ebpf_dir.display()))?;
    env::set_current_dir(&ebpf_dir).map_err(|e| format!("cd {}: {e}", ebpf_dir.display()))?;
    // aya-build turns every line the nested cargo prints into a `cargo:warning`, which cargo
    // replays on every later build; without the "Compiling ..." status lines only real
    // diagnostics (compiler messages, errors) remain.
    // SAFETY: nothing else runs in this process yet (aya-build starts its threads later),
    // so no other thread can read the environment while it changes.
    unsafe { env::set_var("CARGO_TERM_QUIET", "true") };
    let package = aya_build::Package {
        name: EBPF_PACKAGE,
        root_dir: ebpf_dir_str,
        ..Default::default()
    };
    aya_build::build_ebpf([package], aya_build::Toolchain::Custom(&nightly))
        .map_err(|e| format!("{e:#}"))?;

    let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR not set")?);
    let object = out_dir.join(EBPF_PACKAGE);
    if !object.is_file() {
        // aya-build returns Ok without building when AYA_BUILD_SKIP is set; an agent
        // without its programs is useless, so say so here rather than fail at include_bytes.
        return Err(format!(
            "{} was not produced (is AYA_BUILD_SKIP set?); limiter-net embeds it",
            object.display()
        ));
    }
    Ok(())
}

/// The `channel = "..."` of a rust-toolchain.toml: the one line of it this script needs,
/// read without a TOML parser among the build dependencies.
fn pinned_channel(file: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    text.lines()
        .filter_map(|line| line.trim().strip_prefix("channel"))
        .filter_map(|rest| rest.trim_start().strip_prefix('='))
        .map(|value| value.trim().trim_matches('"').to_owned())
        .find(|channel| !channel.is_empty())
        .ok_or_else(|| format!("{} names no `channel = \"...\"`", file.display()))
}

/// Fails with a message naming what is missing and how to install it, instead of the
/// nested cargo's error from deep inside a build-std or linker invocation.
fn check_toolchain(nightly: &str) -> Result<(), String> {
    let sysroot = Command::new("rustup")
        .args(["run", nightly, "rustc", "--print", "sysroot"])
        .output()
        .map_err(|e| format!("cannot run rustup ({e}): the BPF build needs rustup with the {nightly} toolchain; {INSTALL_HINT}"))?;
    if !sysroot.status.success() {
        return Err(format!(
            "the {nightly} Rust toolchain is not installed ({}); {INSTALL_HINT}",
            String::from_utf8_lossy(&sysroot.stderr).trim()
        ));
    }
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_owned();
    let core_src = Path::new(&sysroot).join("lib/rustlib/src/rust/library/core");
    if !core_src.is_dir() {
        return Err(format!(
            "the {nightly} toolchain lacks rust-src (no {}), which -Z build-std=core needs; {INSTALL_HINT}",
            core_src.display()
        ));
    }

    let linker = find_in_path("bpf-linker")
        .ok_or_else(|| format!("bpf-linker is not on PATH; {INSTALL_HINT}"))?;
    // A reinstalled linker (e.g. after a toolchain update broke the old one) must rebuild.
    println!("cargo:rerun-if-changed={}", linker.display());
    let version = Command::new(&linker)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {} ({e}); {INSTALL_HINT}", linker.display()))?;
    if !version.status.success() {
        return Err(format!(
            "{} does not run ({}): it is linked against a Rust toolchain's libLLVM that has \
             changed since; {INSTALL_HINT}",
            linker.display(),
            String::from_utf8_lossy(&version.stderr).trim()
        ));
    }
    Ok(())
}

fn find_in_path(program: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}
