#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::os::unix::fs::symlink;

use nix::sys::stat::{Mode, SFlag, makedev, mknod};

use super::*;
use crate::test_root::require_root_for;

const V: &str = "550.54.15";

/// A driver root laid out as a Debian host's: libraries with their ldconfig links, a
/// tool, and (as root) the control nodes and two GPUs' nodes.
pub(crate) struct FakeRoot {
    pub(crate) dir: tempfile::TempDir,
}

impl FakeRoot {
    pub(crate) fn new() -> Self {
        let f = Self {
            dir: tempfile::tempdir().unwrap(),
        };
        let lib = format!("usr/lib/{MULTIARCH}");
        f.file(&format!("{lib}/libcuda.so.{V}"));
        f.link(&format!("{lib}/libcuda.so.1"), &format!("libcuda.so.{V}"));
        f.link(&format!("{lib}/libcuda.so"), "libcuda.so.1");
        f.file(&format!("{lib}/libnvidia-ml.so.{V}"));
        // An absolute link: followed inside the root, never into the test's own tree.
        f.link(
            &format!("{lib}/libnvidia-ml.so.1"),
            &format!("/{lib}/libnvidia-ml.so.{V}"),
        );
        // An optional library whose soname is not `.so.1`.
        f.file(&format!("{lib}/libnvidia-nvvm.so.{V}"));
        f.link(
            &format!("{lib}/libnvidia-nvvm.so.4"),
            &format!("libnvidia-nvvm.so.{V}"),
        );
        // An older driver's leftover link, which leads to no file of this version.
        f.link(&format!("{lib}/libcuda.so.2"), "libcuda.so.470.1.1");
        f.file("usr/bin/nvidia-smi");
        // Merged /usr: lib -> usr/lib finds the same files, which count once.
        f.link("lib", "/usr/lib");
        f
    }

    pub(crate) fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub(crate) fn file(&self, rel: &str) {
        let p = self.path(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, b"\x7fELF").unwrap();
    }

    pub(crate) fn link(&self, rel: &str, target: &str) {
        let p = self.path(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        symlink(target, p).unwrap();
    }

    /// Character devices with NVIDIA's major number: made, never opened.
    pub(crate) fn nodes(&self, names: &[&str]) {
        self.nodes_from(0, names);
    }

    /// [`Self::nodes`] numbered from `first`.
    pub(crate) fn nodes_from(&self, first: u64, names: &[&str]) {
        fs::create_dir_all(self.path("dev")).unwrap();
        for (minor, n) in (first..).zip(names) {
            mknod(
                &self.path(&format!("dev/{n}")),
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o666),
                makedev(195, minor),
            )
            .unwrap();
        }
    }

    pub(crate) fn root(&self) -> DriverRoot {
        DriverRoot::new(self.dir.path(), None).unwrap()
    }

    pub(crate) fn host(&self, rel: &str) -> PathBuf {
        self.root().host().join(rel)
    }
}

fn mounts_of(files: &DriverFiles) -> Vec<(String, String)> {
    files
        .mounts
        .iter()
        .map(|m| {
            (
                m.container_path.display().to_string(),
                m.host_path
                    .strip_prefix(files.root().host())
                    .unwrap()
                    .display()
                    .to_string(),
            )
        })
        .collect()
}

#[test]
fn a_complete_root_gives_the_nodes_the_libraries_under_every_name_and_the_tools() {
    if !require_root_for(module_path!(), "mknod for the fake device nodes") {
        return;
    }
    let f = FakeRoot::new();
    f.nodes(&["nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"]);
    let files = f.root().discover(Some(V)).unwrap();
    assert_eq!(files.version, V);
    assert_eq!(
        files.control_nodes,
        [
            CdiDeviceNode {
                path: "/dev/nvidiactl".into(),
                host_path: f.host("dev/nvidiactl"),
            },
            CdiDeviceNode {
                path: "/dev/nvidia-uvm".into(),
                host_path: f.host("dev/nvidia-uvm"),
            },
        ],
        "nvidia-uvm-tools is optional and absent here"
    );
    let lib = format!("usr/lib/{MULTIARCH}");
    let m = |name: &str, file: &str| (format!("/{lib}/{name}"), format!("{lib}/{file}"));
    assert_eq!(
        mounts_of(&files),
        [
            m(&format!("libcuda.so.{V}"), &format!("libcuda.so.{V}")),
            m("libcuda.so", &format!("libcuda.so.{V}")),
            m("libcuda.so.1", &format!("libcuda.so.{V}")),
            m(
                &format!("libnvidia-ml.so.{V}"),
                &format!("libnvidia-ml.so.{V}")
            ),
            m("libnvidia-ml.so.1", &format!("libnvidia-ml.so.{V}")),
            m(
                &format!("libnvidia-nvvm.so.{V}"),
                &format!("libnvidia-nvvm.so.{V}")
            ),
            m("libnvidia-nvvm.so.4", &format!("libnvidia-nvvm.so.{V}")),
            ("/usr/bin/nvidia-smi".into(), "usr/bin/nvidia-smi".into()),
        ]
    );
    assert_eq!(files.gpu_node(1).unwrap().host_path, f.host("dev/nvidia1"));
    assert_eq!(files.gpu_node(1).unwrap().path, Path::new("/dev/nvidia1"));
    let e = files.gpu_node(2).unwrap_err().to_string();
    assert!(e.contains("/dev/nvidia2"), "{e}");

    // Without a version from the back end, the one libcuda version there is taken.
    assert_eq!(f.root().discover(None).unwrap(), files);
}

#[test]
fn an_empty_root_names_everything_missing() {
    let dir = tempfile::tempdir().unwrap();
    let e = DriverRoot::new(dir.path(), None)
        .unwrap()
        .discover(Some(V))
        .unwrap_err();
    assert!(matches!(e, GpuError::Unavailable(_)), "{e:?}");
    let e = e.to_string();
    for what in [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm ",
        &format!("libcuda.so.{V}"),
        &format!("libnvidia-ml.so.{V}"),
    ] {
        assert!(e.contains(what), "{what} not named in: {e}");
    }
    assert!(!e.contains("nvidia-uvm-tools"), "optional: {e}");
    assert!(e.contains(&dir.path().display().to_string()), "{e}");
}

#[test]
fn libraries_of_another_driver_version_are_not_taken() {
    let f = FakeRoot::new();
    let e = f
        .root()
        .discover(Some("580.65.06"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("libcuda.so.580.65.06"), "{e}");
    assert!(e.contains("libnvidia-ml.so.580.65.06"), "{e}");
}

#[test]
fn a_required_library_without_its_soname_link_is_missing() {
    let f = FakeRoot::new();
    fs::remove_file(f.path(&format!("usr/lib/{MULTIARCH}/libcuda.so.1"))).unwrap();
    let e = f.root().discover(Some(V)).unwrap_err().to_string();
    assert!(e.contains("soname link"), "{e}");
}

#[test]
fn two_driver_versions_and_no_word_from_the_back_end_is_an_error() {
    let f = FakeRoot::new();
    f.file(&format!("usr/lib/{MULTIARCH}/libcuda.so.580.65.06"));
    let e = f.root().discover(None).unwrap_err().to_string();
    assert!(e.contains("550.54.15, 580.65.06"), "{e}");
}

#[test]
fn a_plain_file_is_no_device_node() {
    let f = FakeRoot::new();
    f.file("dev/nvidiactl");
    let e = f.root().discover(Some(V)).unwrap_err().to_string();
    assert!(e.contains("/dev/nvidiactl (not a character device)"), "{e}");
}

#[test]
fn links_resolve_inside_the_root() {
    let f = FakeRoot::new();
    f.file("etc/passwd-inside");
    f.link("a/b", "../../../../etc/passwd-inside");
    f.link("abs", "/a/b");
    f.link("loop", "loop");
    let root = f.dir.path();
    assert_eq!(
        resolve(root, Path::new("abs")).unwrap(),
        Path::new("etc/passwd-inside")
    );
    assert_eq!(
        resolve(root, Path::new("lib/../usr/bin/nvidia-smi")).unwrap(),
        Path::new("usr/bin/nvidia-smi")
    );
    assert!(resolve(root, Path::new("loop")).is_err());
    assert!(resolve(root, Path::new("nothing")).is_err());
}

#[test]
fn a_relative_driver_root_is_refused() {
    let e = DriverRoot::new(Path::new("run/nvidia/driver"), None).unwrap_err();
    assert!(matches!(e, GpuError::InvalidArgument(_)), "{e:?}");
    let e = DriverRoot::new(Path::new("/"), Some(Path::new("driver-root"))).unwrap_err();
    assert!(matches!(e, GpuError::InvalidArgument(_)), "{e:?}");
}

#[test]
fn driver_versions_are_digits_and_dots() {
    assert!(is_driver_version("550.54.15"));
    assert!(is_driver_version("580.65"));
    assert!(!is_driver_version("1"));
    assert!(!is_driver_version("550..1"));
    assert!(!is_driver_version("550.54.15.bak"));
}

/// In a container that mounts the host's driver root elsewhere (the chart's
/// /driver-root), the files are read there and named by their host paths in the spec.
#[test]
fn a_root_mounted_elsewhere_is_read_there_and_named_as_the_host_has_it() {
    if !require_root_for(module_path!(), "mknod for the fake device nodes") {
        return;
    }
    let f = FakeRoot::new();
    f.nodes(&["nvidiactl", "nvidia-uvm", "nvidia0"]);
    let host = Path::new("/run/nvidia/driver");
    let files = DriverRoot::new(host, Some(f.dir.path()))
        .unwrap()
        .discover(Some(V))
        .unwrap();
    assert_eq!(
        files.gpu_node(0).unwrap().host_path,
        host.join("dev/nvidia0")
    );
    assert!(
        files.mounts.iter().all(|m| m.host_path.starts_with(host)),
        "{:?}",
        files.mounts
    );
}

#[test]
fn a_root_with_nothing_in_it_names_libcuda_too() {
    let dir = tempfile::tempdir().unwrap();
    let e = DriverRoot::new(dir.path(), None)
        .unwrap()
        .discover(None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("/dev/nvidiactl"), "{e}");
    assert!(e.contains("libcuda.so.<driver version>"), "{e}");
}
