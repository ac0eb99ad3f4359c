//! What the `nvml-cgroup` mechanism needs of the kernel's device memory (`dmem`) cgroup
//! controller, probed rather than assumed.
//!
//! NVML's per-cgroup limits (R615+) are the cgroup's `dmem.max` (hard) and `dmem.min`
//! (soft) for the GPU's region: a limit binds only in a cgroup that has those files,
//! i.e. whose parent enables the controller for its children (`cgroup.subtree_control`),
//! and only on a GPU whose driver registered its memory as a region, which the root's
//! `dmem.capacity` lists (one `<region> <bytes>` line each; NVIDIA's are named after
//! the driver and the GPU's PCI address). The symbols being there says neither.
//!
//! Two levels follow from it:
//! - per GPU, at start: the controller exists and the driver accounts device memory in
//!   it ([`driver_regions`]); otherwise the GPU does not offer `nvml-cgroup`;
//! - per share, when it is applied: each cgroup the limit goes on has the controller's
//!   files ([`cgroup_has_dmem`]); otherwise that share falls back (see
//!   [`crate::limiter`]) while the device's other shares keep the hard limit.

use std::io;
use std::path::Path;

/// The file whose presence says the controller is enabled for a cgroup.
pub const DMEM_MAX: &str = "dmem.max";

/// Lines of `dmem.capacity` whose region the NVIDIA driver registered: those named
/// `nvidia...` (the exact form carries the GPU's PCI address).
pub fn nvidia_regions(capacity: &str) -> Vec<String> {
    capacity
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|region| region.starts_with("nvidia"))
        .map(str::to_owned)
        .collect()
}

/// The NVIDIA regions the root cgroup's `dmem.capacity` lists, or why there are none:
/// no such file (a kernel without the controller, before 6.14) or no NVIDIA line (the
/// driver's memory accounting is off).
pub fn driver_regions(cgroup2_root: &Path) -> Result<Vec<String>, String> {
    let file = cgroup2_root.join("dmem.capacity");
    let text = std::fs::read_to_string(&file).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => format!(
            "{} does not exist: the kernel has no dmem cgroup controller (6.14 or later with \
             CONFIG_CGROUP_DMEM), which NVML's per-cgroup limits are held in",
            file.display()
        ),
        _ => format!("reading {}: {e}", file.display()),
    })?;
    let regions = nvidia_regions(&text);
    if regions.is_empty() {
        return Err(format!(
            "{} lists no NVIDIA region: the driver does not account device memory in the dmem \
             controller",
            file.display()
        ));
    }
    Ok(regions)
}

/// Whether a limit can bind in `cgroup`: it has the controller's files. Err says why not.
pub fn cgroup_has_dmem(cgroup: &Path) -> Result<(), String> {
    let file = cgroup.join(DMEM_MAX);
    match std::fs::symlink_metadata(&file) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(format!("{} is not a file", file.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(format!(
            "{} has no {DMEM_MAX}: its parent does not enable the dmem controller for it \
             (cgroup.subtree_control)",
            cgroup.display()
        )),
        Err(e) => Err(format!("reading {}: {e}", file.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_of_the_driver_are_picked_out() {
        let capacity = "drm/0000:03:00.0/vram0 17163091968\n\
                        nvidia/0000:41:00.0/vidmem 85899345920\n\
                        nvidia/0000:c1:00.0/vidmem 85899345920\n\n";
        assert_eq!(
            nvidia_regions(capacity),
            vec![
                "nvidia/0000:41:00.0/vidmem".to_owned(),
                "nvidia/0000:c1:00.0/vidmem".to_owned()
            ]
        );
        assert!(nvidia_regions("").is_empty());
        assert!(nvidia_regions("drm/0000:03:00.0/vram0 1\n").is_empty());
    }

    #[test]
    fn the_root_says_why_there_is_nothing_to_limit_with() {
        let root = tempfile::tempdir().unwrap();
        let none = driver_regions(root.path()).unwrap_err();
        assert!(none.contains("no dmem cgroup controller"), "{none}");
        std::fs::write(root.path().join("dmem.capacity"), "drm/x/vram0 1\n").unwrap();
        let off = driver_regions(root.path()).unwrap_err();
        assert!(off.contains("does not account device memory"), "{off}");
        std::fs::write(
            root.path().join("dmem.capacity"),
            "nvidia/0000:41:00.0/vidmem 1\n",
        )
        .unwrap();
        assert_eq!(driver_regions(root.path()).unwrap().len(), 1);
    }

    #[test]
    fn a_cgroup_without_the_controllers_files_is_named() {
        let cg = tempfile::tempdir().unwrap();
        let why = cgroup_has_dmem(cg.path()).unwrap_err();
        assert!(why.contains("has no dmem.max"), "{why}");
        std::fs::create_dir(cg.path().join(DMEM_MAX)).unwrap();
        assert!(cgroup_has_dmem(cg.path()).is_err());
        std::fs::remove_dir(cg.path().join(DMEM_MAX)).unwrap();
        std::fs::write(cg.path().join(DMEM_MAX), "").unwrap();
        assert_eq!(cgroup_has_dmem(cg.path()), Ok(()));
    }
}
