//! How the check prints sizes, limits, support and read-backs, and reads small files.

use super::*;

pub(crate) fn bytes(b: u64) -> String {
    format!("{:.2} GiB ({b} bytes)", b as f64 / (1u64 << 30) as f64)
}

pub(crate) fn short(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{} MiB", b / MIB)
    }
}

pub(crate) fn section(title: &str) {
    println!();
    println!("== {title} ==");
}

pub(crate) fn limit_text(l: Option<CgroupLimit>) -> String {
    match l {
        None => "no limit".to_string(),
        Some(l) => format!(
            "hard {}, soft {}, used {}",
            short(l.hard_bytes),
            short(l.soft_bytes),
            short(l.used_bytes)
        ),
    }
}

pub(crate) fn support_text(s: &Support) -> String {
    match s {
        Support::Supported => "supported".to_string(),
        Support::Unsupported(why) => format!("not supported: {why}"),
    }
}

/// Small files from /proc and /sys, capped so that nothing odd makes us read forever.
pub(crate) fn read_small(path: &Path) -> std::io::Result<String> {
    let mut s = String::new();
    fs::File::open(path)?
        .take(64 * 1024)
        .read_to_string(&mut s)?;
    Ok(s)
}

pub(crate) fn print_gpu(g: &GpuInfo) {
    println!("gpu {}: {}", g.index, g.uuid);
    println!("  name:          {}", g.name);
    println!("  memory:        {}", bytes(g.total_memory_bytes));
    let mig = match g.mig {
        MigMode::Disabled => "disabled",
        MigMode::Enabled => "enabled",
        MigMode::NotSupported => "not supported by this GPU",
    };
    println!("  MIG mode:      {mig}");
    println!("  driver:        {}", g.driver_version);
}

pub(crate) fn mps_limit_text(r: &Result<Option<MpsLimit>, GpuError>) -> String {
    match r {
        Ok(None) => "no limit (no daemon for the share)".into(),
        Ok(Some(l)) if l.granularity <= MIB && l.bytes % MIB == 0 => {
            format!("{} MiB", l.bytes / MIB)
        }
        Ok(Some(l)) if l.granularity <= MIB => format!("{} bytes", l.bytes),
        // The control program shows limits of 1 GiB and more in whole GiB, rounded down.
        Ok(Some(l)) => format!(
            "at least {} MiB, under {} MiB (shown in whole {})",
            l.bytes / MIB,
            l.bytes.saturating_add(l.granularity) / MIB,
            if l.granularity == 1 << 30 {
                "GiB".to_string()
            } else {
                short(l.granularity)
            }
        ),
        Err(GpuError::NotSupported(why)) => format!("cannot read back (not supported: {why})"),
        Err(e) => format!("cannot read back: {e}"),
    }
}

pub(crate) fn read_back(backend: &dyn GpuBackend, uuid: &str, cgroup: &Path) -> String {
    read_back_text(&backend.cgroup_limit(uuid, cgroup))
}

pub(crate) fn read_back_text(r: &Result<Option<CgroupLimit>, GpuError>) -> String {
    match r {
        Ok(l) => limit_text(*l),
        Err(GpuError::NotSupported(why)) => format!("cannot read back (not supported: {why})"),
        Err(e) => format!("cannot read back: {e}"),
    }
}
