//! What of the NVIDIA driver a container needs to run CUDA on one GPU, found in the
//! driver root: the control device nodes, the GPU's own node, and the driver's user-space
//! libraries and tools, as CDI edits.
//!
//! The driver root is where the driver's files are on the host: `/` for a driver
//! installed on the node, `/run/nvidia/driver` where the GPU Operator's driver container
//! provides it. Device nodes are looked for under its `dev/`, as NVIDIA's container
//! toolkit does by default. What goes in, and why:
//!
//! - `dev/nvidiactl` and `dev/nvidia-uvm` (required: no CUDA context without them),
//!   `dev/nvidia-uvm-tools` (where present: profilers), and the share's GPU as
//!   `dev/nvidia<minor>`, no other GPU's node: the device cgroup then lets the container
//!   open that GPU alone, whatever `CUDA_VISIBLE_DEVICES` a tenant sets.
//! - The compute and utility libraries (`libcuda` and `libnvidia-ml` required, the
//!   others where present), each as the versioned file of the running driver plus every
//!   link beside it that the driver root's `ldconfig` made for it (`libcuda.so.1`,
//!   `libcuda.so`), mounted as files at those names: a CDI spec cannot make symlinks,
//!   and the dynamic linker looks a library up by its soname. They keep the directory
//!   they have in the driver root (`/usr/lib/x86_64-linux-gnu` on Debian and Ubuntu,
//!   `/usr/lib64` on RHEL), which the linker of an image of the same family searches by
//!   default; an image of another family needs that directory in its `LD_LIBRARY_PATH`.
//! - The tools where present (`nvidia-smi`, the MPS control program and server, ...).
//!
//! Everything is mounted read-only, without setuid and device files; libraries and
//! tools need exec. Firmware and graphics libraries are left out: the kernel module
//! loads the one, CUDA needs none of the others.
//!
//! The agent reads the root where its container mounts the host's (`container_driver_root`,
//! as NVIDIA's DRA driver reads it at `/driver-root`), else through pid 1's view
//! (`/proc/1/root`) when it runs in a mount namespace of its own and pid 1 is in sight,
//! because the container runtime resolves the spec's host paths in the host's; else as
//! it is. Symlinks are followed inside the root, so an absolute link in a driver
//! container's tree never leads into the agent's own.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shareguard_common::limiter::{CdiDeviceNode, CdiMount};

use crate::error::GpuError;

/// The libraries without which no CUDA program (libcuda) and no NVML tool
/// (libnvidia-ml, which nvidia-smi loads) runs.
const REQUIRED_LIBS: [&str; 2] = ["libcuda", "libnvidia-ml"];
/// The rest of the driver's compute and utility libraries, mounted where present.
const OPTIONAL_LIBS: [&str; 9] = [
    "libnvidia-ptxjitcompiler",
    "libnvidia-nvvm",
    "libcudadebugger",
    "libnvidia-gpucomp",
    "libnvidia-allocator",
    "libnvidia-cfg",
    "libnvidia-opencl",
    "libnvidia-pkcs11",
    "libnvidia-pkcs11-openssl3",
];
const TOOLS: [&str; 5] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];
const REQUIRED_NODES: [&str; 2] = ["nvidiactl", "nvidia-uvm"];
const OPTIONAL_NODES: [&str; 1] = ["nvidia-uvm-tools"];
/// How long a finding stands before the root is looked at again: a driver container
/// that installs its files after the agent started is seen within this, and every
/// share's Prepare does not cost a walk of the root.
const RECHECK: Duration = Duration::from_secs(5);
/// Symlink hops followed before a path is taken for a loop (the kernel's limit).
const MAX_LINKS: u32 = 40;

#[cfg(target_arch = "aarch64")]
const MULTIARCH: &str = "aarch64-linux-gnu";
#[cfg(not(target_arch = "aarch64"))]
const MULTIARCH: &str = "x86_64-linux-gnu";

/// Library directories searched, first match wins (relative to the driver root).
fn lib_dirs() -> [String; 6] {
    [
        format!("usr/lib/{MULTIARCH}"),
        "usr/lib64".into(),
        format!("lib/{MULTIARCH}"),
        "lib64".into(),
        "usr/lib".into(),
        "lib".into(),
    ]
}

/// A driver root as the container runtime sees it (`host`) and as the agent reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverRoot {
    host: PathBuf,
    read: PathBuf,
}

/// What a container of any share needs of the driver, plus the GPU nodes found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverFiles {
    /// The driver version the libraries are of (`libcuda.so.<version>`).
    pub version: String,
    pub control_nodes: Vec<CdiDeviceNode>,
    pub mounts: Vec<CdiMount>,
    root: DriverRoot,
}

impl DriverRoot {
    /// `host` must be absolute. The agent reads it at `seen_at`, where its container
    /// mounts the host's driver root; without one, through pid 1's root where pid 1 is
    /// in another mount namespace and in sight (hostPID), else as it is.
    pub fn new(host: &Path, seen_at: Option<&Path>) -> Result<Self, GpuError> {
        let rel = relative(host)?;
        let read = match (seen_at, host_view()) {
            (Some(at), _) => {
                relative(at)?;
                at.to_path_buf()
            }
            (None, Some(init_root)) => init_root.join(rel),
            (None, None) => host.to_path_buf(),
        };
        Ok(Self {
            host: host.to_path_buf(),
            read,
        })
    }

    pub fn host(&self) -> &Path {
        &self.host
    }

    /// Finds the driver's files. `driver_version` is the running driver's as the back
    /// end reports it (None where it cannot, as the simulated back end): the libraries
    /// must be of that version. Missing required files are one error naming each.
    pub fn discover(&self, driver_version: Option<&str>) -> Result<DriverFiles, GpuError> {
        let mut missing = Vec::new();
        let mut control_nodes = Vec::new();
        for (name, required) in REQUIRED_NODES
            .iter()
            .map(|n| (n, true))
            .chain(OPTIONAL_NODES.iter().map(|n| (n, false)))
        {
            match self.node(name) {
                Ok(n) => control_nodes.push(n),
                Err(why) if required => missing.push(why),
                Err(_) => {}
            }
        }
        let dirs = lib_dirs();
        let version = match driver_version {
            Some(v) => Some(v.to_owned()),
            None => match self.versions_of("libcuda", &dirs) {
                Ok(v) if v.len() == 1 => v.into_iter().next(),
                Ok(v) if v.is_empty() => None,
                Ok(v) => {
                    missing.push(format!(
                        "one driver version: libcuda.so of versions {} is there, and the \
                         back end cannot say which one runs",
                        v.join(", ")
                    ));
                    None
                }
                Err(e) => {
                    missing.push(e);
                    None
                }
            },
        };
        let mut mounts = Vec::new();
        match &version {
            Some(v) => {
                for (lib, required) in REQUIRED_LIBS
                    .iter()
                    .map(|l| (l, true))
                    .chain(OPTIONAL_LIBS.iter().map(|l| (l, false)))
                {
                    match self.library(lib, v, &dirs, required) {
                        Ok(Some(m)) => mounts.extend(m),
                        Ok(None) if required => missing.push(format!(
                            "{lib}.so.{v} (searched {} under the root)",
                            dirs.join(", ")
                        )),
                        Ok(None) => {}
                        Err(e) => missing.push(e),
                    }
                }
            }
            // Unless the versions were the problem, said above.
            None if !missing.iter().any(|m| m.starts_with("one driver version")) => {
                missing.push(format!(
                    "libcuda.so.<driver version> (searched {} under the root)",
                    dirs.join(", ")
                ))
            }
            None => {}
        }
        for tool in TOOLS {
            let rel = PathBuf::from("usr/bin").join(tool);
            if let Ok(real) = resolve(&self.read, &rel)
                && fs::metadata(self.read.join(&real)).is_ok_and(|m| m.is_file())
            {
                mounts.push(CdiMount {
                    host_path: self.host.join(real),
                    container_path: Path::new("/").join(rel),
                });
            }
        }
        if !missing.is_empty() {
            return Err(GpuError::Unavailable(format!(
                "driver root {}: missing what a CUDA program needs: {}",
                self.host.display(),
                missing.join("; ")
            )));
        }
        Ok(DriverFiles {
            version: version.unwrap_or_default(),
            control_nodes,
            mounts,
            root: self.clone(),
        })
    }

    /// `dev/<name>` as a character device.
    fn node(&self, name: &str) -> Result<CdiDeviceNode, String> {
        let rel = PathBuf::from("dev").join(name);
        let real = resolve(&self.read, &rel).map_err(|e| format!("/dev/{name} ({e})"))?;
        match fs::metadata(self.read.join(&real)) {
            Ok(m) if m.file_type().is_char_device() => Ok(CdiDeviceNode {
                path: Path::new("/").join(&rel),
                host_path: self.host.join(real),
            }),
            Ok(_) => Err(format!("/dev/{name} (not a character device)")),
            Err(e) => Err(format!("/dev/{name} ({e})")),
        }
    }

    /// The versions of `lib.so.<version>` files in the first directory that has any.
    fn versions_of(&self, lib: &str, dirs: &[String]) -> Result<Vec<String>, String> {
        let prefix = format!("{lib}.so.");
        for dir in dirs {
            let Ok(real_dir) = resolve(&self.read, Path::new(dir)) else {
                continue;
            };
            let Ok(entries) = fs::read_dir(self.read.join(&real_dir)) else {
                continue;
            };
            let mut found: Vec<String> = entries
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().into_string().ok())
                .filter_map(|n| n.strip_prefix(&prefix).map(str::to_owned))
                .filter(|v| is_driver_version(v))
                .collect();
            if !found.is_empty() {
                found.sort();
                found.dedup();
                return Ok(found);
            }
        }
        Ok(Vec::new())
    }

    /// `lib.so.<version>` in the first directory that has it, and the links beside it
    /// that lead to it. None when no directory has it; an error for a required library
    /// without its soname link, which no program could then find.
    fn library(
        &self,
        lib: &str,
        version: &str,
        dirs: &[String],
        required: bool,
    ) -> Result<Option<Vec<CdiMount>>, String> {
        let file = format!("{lib}.so.{version}");
        for dir in dirs {
            let rel = Path::new(dir).join(&file);
            let Ok(real) = resolve(&self.read, &rel) else {
                continue;
            };
            if !fs::metadata(self.read.join(&real)).is_ok_and(|m| m.is_file()) {
                continue;
            }
            let mut names = vec![file.clone()];
            let linker_name = format!("{lib}.so");
            let prefix = format!("{linker_name}.");
            let real_dir =
                resolve(&self.read, Path::new(dir)).map_err(|e| format!("{dir}: {e}"))?;
            let mut links: Vec<String> = fs::read_dir(self.read.join(&real_dir))
                .map_err(|e| format!("{dir}: {e}"))?
                .filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_symlink()))
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| *n == linker_name || n.starts_with(&prefix))
                .filter(|n| *n != file)
                .filter(|n| resolve(&self.read, &Path::new(dir).join(n)).is_ok_and(|r| r == real))
                .collect();
            links.sort();
            if required && !links.iter().any(|n| *n != linker_name) {
                return Err(format!(
                    "the soname link to {dir}/{file} (such as {lib}.so.1; ldconfig in the \
                     driver root makes it)"
                ));
            }
            names.extend(links);
            let host_path = self.host.join(&real);
            return Ok(Some(
                names
                    .into_iter()
                    .map(|n| CdiMount {
                        host_path: host_path.clone(),
                        container_path: Path::new("/").join(dir).join(n),
                    })
                    .collect(),
            ));
        }
        Ok(None)
    }
}

impl DriverFiles {
    /// The driver root these files were found in.
    pub fn root(&self) -> &DriverRoot {
        &self.root
    }

    /// The node of the GPU with this minor number, `/dev/nvidia<minor>`.
    pub fn gpu_node(&self, minor: u32) -> Result<CdiDeviceNode, GpuError> {
        self.root.node(&format!("nvidia{minor}")).map_err(|why| {
            GpuError::Unavailable(format!(
                "driver root {}: missing the GPU's device node {why}",
                self.root.host.display()
            ))
        })
    }
}

/// What one GPU device's containers get of the driver: the control nodes and its own
/// GPU's node, the libraries and tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverEdits {
    pub device_nodes: Vec<CdiDeviceNode>,
    pub mounts: Vec<CdiMount>,
}

/// One GPU device's driver files, found at start and looked for again at most every
/// few seconds, so that a root completed later is taken and one that lost files is
/// noticed.
#[derive(Debug)]
pub struct DeviceDriver {
    root: DriverRoot,
    version: Option<String>,
    minor: Option<u32>,
    found: Mutex<(Instant, Result<Arc<DriverEdits>, String>)>,
}

impl DeviceDriver {
    /// `version`: the running driver's, where the back end knows it; `minor`: the
    /// GPU's device node number.
    pub fn new(root: DriverRoot, version: Option<String>, minor: Option<u32>) -> Self {
        let found = Self::find(&root, version.as_deref(), minor);
        Self {
            root,
            version,
            minor,
            found: Mutex::new((Instant::now(), found)),
        }
    }

    pub fn root(&self) -> &Path {
        self.root.host()
    }

    /// The edits, or why the driver root cannot serve a CUDA program on this GPU.
    pub fn edits(&self) -> Result<Arc<DriverEdits>, String> {
        let mut found = self
            .found
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if found.0.elapsed() >= RECHECK {
            *found = (
                Instant::now(),
                Self::find(&self.root, self.version.as_deref(), self.minor),
            );
        }
        found.1.clone()
    }

    /// Makes the next [`Self::edits`] look at the root again (tests: no 5 s wait).
    #[cfg(test)]
    pub(crate) fn look_again(&self) {
        let mut found = self
            .found
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(past) = Instant::now().checked_sub(RECHECK) {
            found.0 = past;
        }
    }

    fn find(
        root: &DriverRoot,
        version: Option<&str>,
        minor: Option<u32>,
    ) -> Result<Arc<DriverEdits>, String> {
        let plain = |e: GpuError| match e {
            GpuError::Unavailable(m) => m,
            other => other.to_string(),
        };
        let files = root.discover(version).map_err(plain)?;
        let minor = minor.ok_or_else(|| {
            format!(
                "the driver does not say the GPU's minor number, so its device node in {} is unknown",
                root.host().display()
            )
        })?;
        let gpu = files.gpu_node(minor).map_err(plain)?;
        let mut device_nodes = files.control_nodes;
        device_nodes.push(gpu);
        Ok(Arc::new(DriverEdits {
            device_nodes,
            mounts: files.mounts,
        }))
    }
}

/// `550.54.15`, `580.65.06`: digits in at least two dot-separated parts.
fn is_driver_version(v: &str) -> bool {
    let parts: Vec<&str> = v.split('.').collect();
    parts.len() >= 2
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

/// `host` without its leading `/`; an error for a relative path.
fn relative(host: &Path) -> Result<&Path, GpuError> {
    host.strip_prefix("/").map_err(|_| {
        GpuError::InvalidArgument(format!(
            "driver root {} is not an absolute path",
            host.display()
        ))
    })
}

/// `/proc/1/root` when pid 1 is in sight and in another mount namespace than ours.
fn host_view() -> Option<PathBuf> {
    let ours = fs::read_link("/proc/self/ns/mnt").ok()?;
    let theirs = fs::read_link("/proc/1/ns/mnt").ok()?;
    (ours != theirs).then(|| PathBuf::from("/proc/1/root"))
}

/// `rel` resolved inside `root` as if `root` were `/`: every symlink followed, an
/// absolute target taken from `root`, `..` never above it. Returns the path relative
/// to `root` with no symlink in it.
pub fn resolve(root: &Path, rel: &Path) -> io::Result<PathBuf> {
    let mut out = PathBuf::new();
    let mut todo: VecDeque<OsString> = VecDeque::new();
    push_front(&mut todo, rel);
    let mut hops = 0;
    while let Some(part) = todo.pop_front() {
        let cand = out.join(&part);
        let meta = fs::symlink_metadata(root.join(&cand))?;
        if !meta.file_type().is_symlink() {
            out = cand;
            continue;
        }
        hops += 1;
        if hops > MAX_LINKS {
            return Err(io::Error::other("too many levels of symbolic links"));
        }
        let target = fs::read_link(root.join(&cand))?;
        if target.is_absolute() {
            out.clear();
        }
        // `..` in a target climbs from the link's directory, never above the root.
        let mut parts: Vec<OsString> = Vec::new();
        for c in target.components() {
            match c {
                Component::Normal(n) => parts.push(n.to_owned()),
                Component::ParentDir => {
                    if parts.pop().is_none() {
                        out.pop();
                    }
                }
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            }
        }
        for p in parts.into_iter().rev() {
            todo.push_front(p);
        }
    }
    Ok(out)
}

/// The normal components of `rel`, in order, in front of `todo`; `..` drops the one
/// before it (and is dropped at the start: nothing is above the root).
fn push_front(todo: &mut VecDeque<OsString>, rel: &Path) {
    let mut parts: Vec<OsString> = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => parts.push(n.to_owned()),
            Component::ParentDir => {
                parts.pop();
            }
            _ => {}
        }
    }
    for p in parts.into_iter().rev() {
        todo.push_front(p);
    }
}

#[cfg(test)]
#[path = "driver_tests.rs"]
pub(crate) mod tests;
