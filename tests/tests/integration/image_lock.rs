//! `make image`'s base from its lock (scripts/image.sh, `IMAGE_BASE=locked`): a version
//! the Debian mirror does not serve, a digest the package does not have, or a package
//! the lock lacks fails the build naming the package and the lock, before the binary is
//! compiled, and writes no image.

#![allow(clippy::unwrap_used)] // A panic is this test's failure; it says where.

use std::{path::Path, process::Command};

use shareguard_tests::shell::privileged;

/// Runs scripts/image.sh with `lock` as its lock file and a fresh output directory:
/// whether it succeeded, its stdout and stderr together, and whether it wrote an image.
fn image_with_lock(lock: &str) -> (bool, String, bool) {
    let dir = tempfile::tempdir().unwrap();
    let lock_file = dir.path().join("base.lock");
    std::fs::write(&lock_file, lock).unwrap();
    let out_dir = dir.path().join("out");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(repo.join("scripts/image.sh"))
        .env("IMAGE_LOCK_FILE", &lock_file)
        .env("IMAGE_OUT", &out_dir)
        .env("IMAGE_ARCHES", "amd64")
        .env_remove("IMAGE_BASE")
        .env_remove("IMAGE_LOCK")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let wrote_image = out_dir.join("shareguard.oci.tar").exists();
    (out.status.success(), text, wrote_image)
}

#[test]
fn a_lock_the_mirror_cannot_serve_fails_before_the_build_naming_the_package() {
    // apt-get download and dpkg need root, as `make image` does.
    if !privileged("a_lock_the_mirror_cannot_serve_fails_before_the_build_naming_the_package") {
        return;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let real = std::fs::read_to_string(repo.join("image/base.lock")).unwrap();
    let libmd = real
        .lines()
        .find(|l| l.starts_with("amd64 libmd0 "))
        .expect("image/base.lock pins amd64 libmd0")
        .to_owned();
    let fields: Vec<&str> = libmd.split_whitespace().collect();
    let (version, sum) = (fields[2], fields[3]);

    let cases = [
        (
            real.replace(&libmd, &format!("amd64 libmd0 0.0.0-shareguard-test {sum}")),
            "the Debian mirror does not serve libmd0:amd64 0.0.0-shareguard-test (",
        ),
        (
            real.replace(
                &libmd,
                &format!("amd64 libmd0 {version} {}", "0".repeat(64)),
            ),
            &*format!("base.lock pins {}", "0".repeat(64)),
        ),
        (
            real.replace(&format!("{libmd}\n"), ""),
            "base.lock has no amd64 libmd0: build with IMAGE_BASE=current IMAGE_LOCK=1",
        ),
    ];
    for (lock, want) in cases {
        let (ok, text, wrote_image) = image_with_lock(&lock);
        assert!(!ok, "built with a bad lock:\n{text}");
        assert!(text.contains(want), "wanted {want:?} in:\n{text}");
        assert!(
            !text.contains("cargo build --release"),
            "the binary was built before the base failed:\n{text}"
        );
        assert!(!wrote_image);
    }
}
