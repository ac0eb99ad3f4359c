//! The node the agent runs on, and what of one agent.toml differs from node to node.
//!
//! One agent.toml (one ConfigMap) serves every node a DaemonSet reaches, but the
//! scheduler names a device by driver, pool and device name, with no node in the key:
//! two nodes publishing one pool would have the capacity used on one subtracted on both,
//! and both would write slices of that pool with competing generations. So a device's
//! pool is the node's name unless the config sets one, and `[[node]]` tables change a
//! device's fields (its interface, its GPU, its pool) on the one node they name.

use std::ops::Range;

use toml::{
    Spanned,
    de::{DeTable, DeValue},
};

/// Where the node's name comes from when `[agent] node_name` does not give it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeNameSources {
    /// `--node-name` or `NODE_NAME` (in the DaemonSet, `spec.nodeName` through the
    /// downward API).
    pub given: Option<String>,
    /// The kernel's host name, lower-cased: kubelet's node name unless it was told
    /// another (`--hostname-override`). None where it cannot be read.
    pub host: Option<String>,
}

impl NodeNameSources {
    /// `given`, and this machine's host name as the last resort.
    pub fn this_host(given: Option<String>) -> Self {
        Self {
            given,
            host: host_name(),
        }
    }
}

/// The kernel's nodename of this UTS namespace, as kubelet derives its default node
/// name from it (Go's `os.Hostname` reads this file): trimmed and lower-cased.
pub fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_ascii_lowercase())
}

/// Why `s` cannot be a node's name, or None. Node names are DNS subdomains (RFC 1123),
/// which is also what makes the node's name a valid pool name.
pub fn node_name_problem(s: &str) -> Option<String> {
    const RULE: &str = "a node name is a DNS subdomain: lowercase letters, digits, '-' and '.', at most 253 characters, each '.'-separated part 1 to 63 characters that starts and ends with a letter or digit";
    let why = if s.is_empty() {
        "it is empty".to_owned()
    } else if s.len() > 253 {
        format!("it has {} characters", s.len())
    } else if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '.'))
    {
        format!("it contains {c:?}")
    } else if let Some(part) = s
        .split('.')
        .find(|p| p.is_empty() || p.len() > 63 || p.starts_with('-') || p.ends_with('-'))
    {
        if part.is_empty() {
            "it has an empty part between dots".to_owned()
        } else if part.len() > 63 {
            format!("its part {part:?} has more than 63 characters")
        } else {
            format!("its part {part:?} starts or ends with '-'")
        }
    } else {
        return None;
    };
    Some(format!("{why} ({RULE})"))
}

/// Whether `pool` belongs to `node`: the node's name, or below it ("<node>/..."). The
/// admission policy in deploy/admission.yaml lets a node's kubelet plugin write only
/// such pools.
pub fn pool_belongs_to(pool: &str, node: &str) -> bool {
    pool == node
        || pool
            .strip_prefix(node)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// A config error: the byte span it is about (None: not in the file, e.g. a flag) and
/// the message.
pub(crate) type Problem = (Option<Range<usize>>, String);

/// The node's name as far as the sources give one. A host name that is no node name is
/// reported only where a name is needed, so that a config that sets every pool and has
/// no `[[node]]` table starts on a host whatever its name.
#[derive(Debug)]
pub(crate) struct NodeName(Result<String, String>);

impl NodeName {
    /// `[agent] node_name`, else `sources.given`, else the host name. A name given
    /// in the config and another given by the flag or environment are an error, not a
    /// choice: a `node_name` in a ConfigMap that serves many nodes would give all of
    /// them one pool again.
    pub(crate) fn resolve(
        configured: Option<&Spanned<String>>,
        sources: &NodeNameSources,
    ) -> Result<NodeName, Problem> {
        if let Some(c) = configured {
            if let Some(why) = node_name_problem(c.get_ref()) {
                return Err((
                    Some(c.span()),
                    format!(
                        "agent.node_name: {:?} is not a node name: {why}",
                        c.get_ref()
                    ),
                ));
            }
            if let Some(g) = &sources.given
                && g != c.get_ref()
            {
                return Err((
                    Some(c.span()),
                    format!(
                        "agent.node_name {:?} and --node-name/NODE_NAME {g:?} name different nodes; set one of them (in a config that several nodes share, only the flag or the environment)",
                        c.get_ref()
                    ),
                ));
            }
            return Ok(NodeName(Ok(c.get_ref().clone())));
        }
        if let Some(g) = &sources.given {
            if let Some(why) = node_name_problem(g) {
                return Err((
                    None,
                    format!("--node-name/NODE_NAME: {g:?} is not a node name: {why}"),
                ));
            }
            return Ok(NodeName(Ok(g.clone())));
        }
        let host = match &sources.host {
            None => Err(
                "the host name cannot be read from /proc/sys/kernel/hostname; set [agent] node_name or --node-name/NODE_NAME".to_owned(),
            ),
            Some(h) => match node_name_problem(h) {
                None => Ok(h.clone()),
                Some(why) => Err(format!(
                    "the host name {h:?} is not a node name: {why}; set [agent] node_name or --node-name/NODE_NAME"
                )),
            },
        };
        Ok(NodeName(host))
    }

    /// The name where one is known.
    pub(crate) fn known(&self) -> Option<&str> {
        self.0.as_deref().ok()
    }

    /// The name, or why there is none.
    pub(crate) fn need(&self) -> Result<&str, &str> {
        match &self.0 {
            Ok(n) => Ok(n),
            Err(why) => Err(why),
        }
    }
}

/// One `[[node]]` table: the node's exact name and, per device name, the fields that
/// differ there.
#[derive(Clone, Debug)]
pub(crate) struct NodeOverride<'i> {
    pub name: Spanned<String>,
    pub devices: Vec<(Spanned<String>, DeTable<'i>)>,
}

fn text_of(v: &Spanned<DeValue<'_>>) -> Option<String> {
    match v.get_ref() {
        DeValue::String(s) => Some(s.to_string()),
        _ => None,
    }
}

/// Takes the `[[node]]` tables out of the document (the rest is deserialized as
/// before), checked for their shape: each has a valid, unique `name` and a `device`
/// table of tables, and changes no device's `name`.
pub(crate) fn take_overrides<'i>(root: &mut DeTable<'i>) -> Result<Vec<NodeOverride<'i>>, Problem> {
    let Some(nodes) = root.remove("node") else {
        return Ok(Vec::new());
    };
    let span = nodes.span();
    let DeValue::Array(entries) = nodes.into_inner() else {
        return Err((
            Some(span),
            "node: write one [[node]] table per node (with name = \"<node name>\")".to_owned(),
        ));
    };
    let mut out: Vec<NodeOverride<'i>> = Vec::new();
    for entry in entries {
        let espan = entry.span();
        let DeValue::Table(table) = entry.into_inner() else {
            return Err((
                Some(espan),
                "node: each element is a [[node]] table".to_owned(),
            ));
        };
        let mut name = None;
        let mut devices = Vec::new();
        for (key, value) in table {
            match key.get_ref().as_ref() {
                "name" => {
                    let n = text_of(&value).ok_or_else(|| {
                        (
                            Some(value.span()),
                            "[[node]] name: must be a string".to_owned(),
                        )
                    })?;
                    if let Some(why) = node_name_problem(&n) {
                        return Err((
                            Some(value.span()),
                            format!("[[node]] name: {n:?} is not a node name: {why}"),
                        ));
                    }
                    name = Some(Spanned::new(value.span(), n));
                }
                "device" => {
                    let vspan = value.span();
                    let DeValue::Table(devs) = value.into_inner() else {
                        return Err((
                            Some(vspan),
                            "[[node]] device: must be a table of devices ([node.device.<device name>])".to_owned(),
                        ));
                    };
                    for (dev, fields) in devs {
                        let fspan = fields.span();
                        let DeValue::Table(fields) = fields.into_inner() else {
                            return Err((
                                Some(fspan),
                                format!(
                                    "[[node]] device.{}: must be a table of the device's fields",
                                    dev.get_ref()
                                ),
                            ));
                        };
                        if let Some((k, _)) = fields.get_key_value("name") {
                            return Err((
                                Some(k.span()),
                                format!(
                                    "[[node]] device.{}: name cannot differ per node: it is what the table is keyed by",
                                    dev.get_ref()
                                ),
                            ));
                        }
                        devices.push((Spanned::new(dev.span(), dev.get_ref().to_string()), fields));
                    }
                }
                other => {
                    return Err((
                        Some(key.span()),
                        format!(
                            "[[node]]: unknown key {other:?}; a [[node]] table has name and device"
                        ),
                    ));
                }
            }
        }
        let name = name.ok_or_else(|| {
            (
                Some(espan.clone()),
                "[[node]]: name is required (the node's exact name)".to_owned(),
            )
        })?;
        if out.iter().any(|o| o.name.get_ref() == name.get_ref()) {
            return Err((
                Some(name.span()),
                format!("[[node]] name {:?} is given twice", name.get_ref()),
            ));
        }
        out.push(NodeOverride { name, devices });
    }
    Ok(out)
}

/// `root`'s devices changed by `o`. A table in the override merges into the device's
/// table key by key (so `[node.device.nic-0.capacity.bandwidth] value = "25G"` keeps
/// that capacity's policy); any other value (a string, a number, an array) replaces the
/// device's own. A device name the config does not define is an error: a typo would
/// otherwise leave the node with the shared value, unnoticed.
pub(crate) fn apply<'i>(root: &mut DeTable<'i>, o: &NodeOverride<'i>) -> Result<(), Problem> {
    for (dev, fields) in &o.devices {
        let mut found = false;
        if let Some(devices) = root.get_mut("device")
            && let DeValue::Array(devices) = devices.get_mut()
        {
            for d in devices.iter_mut() {
                if let DeValue::Table(t) = d.get_mut()
                    && t.get("name").and_then(text_of).as_deref() == Some(dev.get_ref())
                {
                    merge(t, fields);
                    found = true;
                }
            }
        }
        if !found {
            return Err((
                Some(dev.span()),
                format!(
                    "[[node]] {}: device {:?} is not a [[device]] of this config",
                    o.name.get_ref(),
                    dev.get_ref()
                ),
            ));
        }
    }
    Ok(())
}

fn merge<'i>(into: &mut DeTable<'i>, from: &DeTable<'i>) {
    for (k, v) in from.iter() {
        if let DeValue::Table(sub) = v.get_ref()
            && let Some(existing) = into.get_mut(k.get_ref().as_ref())
            && let DeValue::Table(e) = existing.get_mut()
        {
            merge(e, sub);
            continue;
        }
        // Removed first: an equal key already in the map would keep its own span.
        into.remove(k.get_ref().as_ref());
        into.insert(k.clone(), v.clone());
    }
}

#[cfg(test)]
#[path = "node_tests.rs"]
mod tests;
