//! A fenced instance passes kubelet's calls on to the instance that replaced it.
//!
//! During a rolling update two instances of the plugin serve one driver on one node,
//! each on its own sockets (`--instance-id`). The new one takes a new epoch as soon as
//! its DRA socket serves, and the agent refuses the old one from then on, but kubelet
//! keeps calling the old one until it has registered the new one (its plugin watcher
//! runs once a second) and even then a call it had already sent may arrive late. Such a
//! call is not refused: the old instance hands it, unchanged, to the newest other
//! socket in the driver's directory, whose answer goes back to kubelet. The new
//! instance reads the claim from the API server itself, so nothing of the old one's
//! state travels. A call passed on once is never passed on again, so two fenced
//! instances cannot pass a call back and forth.

use std::{
    os::unix::fs::FileTypeExt,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use shareguard_proto::{
    kubelet::dra_v1::{self as v1, dra_plugin_client::DraPluginClient},
    v1 as pb,
};
use tracing::{info, warn};

use crate::answer::{Answers, DeviceAnswer};

/// Set on a call one instance passed on to another; the value is the sender's epoch.
pub const FORWARDED_BY: &str = "x-shareguard-forwarded-by";

/// The driver's other DRA sockets, where a successor serves.
#[derive(Clone, Debug)]
pub struct Successors {
    own: PathBuf,
}

impl Successors {
    /// `own` is this instance's DRA socket; the others are its siblings.
    pub fn new(own: &Path) -> Self {
        Self {
            own: own.to_path_buf(),
        }
    }

    /// Every other instance's DRA socket (`dra.sock` or `dra-<id>.sock`), newest first:
    /// the newest is the one that fenced this one. Sockets left by killed instances are
    /// among them and refuse the connection.
    fn candidates(&self) -> Vec<PathBuf> {
        let Some(dir) = self.own.parent() else {
            return Vec::new();
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut found: Vec<(SystemTime, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter(|e| is_dra_socket_name(&e.file_name().to_string_lossy()))
            .filter(|e| e.path() != self.own)
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                m.file_type()
                    .is_socket()
                    .then(|| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), e.path()))
            })
            .collect();
        found.sort_by_key(|(t, _)| std::cmp::Reverse(*t));
        found.into_iter().map(|(_, p)| p).collect()
    }

    async fn client(
        &self,
        deadline: Duration,
    ) -> Option<(PathBuf, DraPluginClient<tonic::transport::Channel>)> {
        for path in self.candidates() {
            let connect = shareguard_uds::client::connect(&path);
            match tokio::time::timeout(deadline, connect).await {
                Ok(Ok(channel)) => return Some((path, DraPluginClient::new(channel))),
                Ok(Err(e)) => info!(socket = %path.display(), error = %e, "not a live instance"),
                Err(_) => info!(socket = %path.display(), "no answer to a connection"),
            }
        }
        None
    }

    /// Whether another instance answers on its socket within `timeout`.
    pub async fn any_live(&self, timeout: Duration) -> bool {
        self.client(timeout).await.is_some()
    }

    /// kubelet's NodePrepareResources, answered by the successor; None when no other
    /// instance could be reached, and the caller answers itself.
    pub async fn prepare(
        &self,
        claims: &[pb::ClaimRef],
        epoch: u64,
        timeout: Duration,
    ) -> Option<Answers<Vec<DeviceAnswer>>> {
        let (path, mut client) = self.client(timeout).await?;
        let mut req = tonic::Request::new(v1::NodePrepareResourcesRequest {
            claims: claims.iter().map(kubelet_claim).collect(),
        });
        mark(&mut req, epoch, timeout);
        let answered = client
            .node_prepare_resources(req)
            .await
            .map(|r| r.into_inner().claims);
        Some(per_claim(
            claims,
            answered,
            "NodePrepareResources",
            &path,
            |a| {
                if a.error.is_empty() {
                    Ok(a.devices.into_iter().map(device_answer).collect())
                } else {
                    Err(a.error)
                }
            },
        ))
    }

    /// kubelet's NodeUnprepareResources, answered by the successor; None as for
    /// [`Successors::prepare`].
    pub async fn unprepare(
        &self,
        claims: &[pb::ClaimRef],
        epoch: u64,
        timeout: Duration,
    ) -> Option<Answers<()>> {
        let (path, mut client) = self.client(timeout).await?;
        let mut req = tonic::Request::new(v1::NodeUnprepareResourcesRequest {
            claims: claims.iter().map(kubelet_claim).collect(),
        });
        mark(&mut req, epoch, timeout);
        let answered = client
            .node_unprepare_resources(req)
            .await
            .map(|r| r.into_inner().claims);
        Some(per_claim(
            claims,
            answered,
            "NodeUnprepareResources",
            &path,
            |a| {
                if a.error.is_empty() {
                    Ok(())
                } else {
                    Err(a.error)
                }
            },
        ))
    }
}

/// The successor's answer, claim by claim in the order kubelet asked: `take` turns a
/// claim's entry into this instance's answer; a failed call fails every claim.
fn per_claim<A, T>(
    claims: &[pb::ClaimRef],
    answered: Result<std::collections::HashMap<String, A>, tonic::Status>,
    call: &str,
    socket: &Path,
    take: impl Fn(A) -> Result<T, String>,
) -> Answers<T> {
    match answered {
        Ok(mut answers) => {
            info!(socket = %socket.display(), claims = claims.len(), "passed kubelet's {call} on to the instance that replaced this one");
            claims
                .iter()
                .map(|c| {
                    let a = answers
                        .remove(&c.uid)
                        .map_or_else(|| Err(NO_ANSWER.to_owned()), &take);
                    (c.uid.clone(), a)
                })
                .collect()
        }
        Err(s) => {
            warn!(socket = %socket.display(), error = %s, "the instance that replaced this one failed {call}");
            claims
                .iter()
                .map(|c| (c.uid.clone(), Err(failed(&s))))
                .collect()
        }
    }
}

const NO_ANSWER: &str =
    "the kubelet plugin instance that replaced this one gave no answer for the claim";

fn failed(s: &tonic::Status) -> String {
    format!(
        "passing the call on to the kubelet plugin instance that replaced this one: {:?}: {}",
        s.code(),
        s.message()
    )
}

fn mark<T>(req: &mut tonic::Request<T>, epoch: u64, timeout: Duration) {
    req.set_timeout(timeout);
    // A number always makes a valid header value.
    if let Ok(v) = epoch.to_string().parse() {
        req.metadata_mut().insert(FORWARDED_BY, v);
    }
}

/// `dra.sock` (an instance without `--instance-id`) or `dra-<id>.sock`.
pub fn is_dra_socket_name(name: &str) -> bool {
    name == "dra.sock"
        || name
            .strip_prefix("dra-")
            .and_then(|r| r.strip_suffix(".sock"))
            .is_some_and(|id| !id.is_empty())
}

fn kubelet_claim(c: &pb::ClaimRef) -> v1::Claim {
    v1::Claim {
        namespace: c.namespace.clone(),
        uid: c.uid.clone(),
        name: c.name.clone(),
    }
}

/// The inverse of `dra::v1_device`: kubelet's answer from the successor, as this
/// instance would have given it.
fn device_answer(d: v1::Device) -> DeviceAnswer {
    DeviceAnswer {
        request: d.request_names.into_iter().next().unwrap_or_default(),
        pool: d.pool_name,
        device: d.device_name,
        share_id: d.share_id,
        cdi_device_ids: d.cdi_device_ids,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_dra_sockets_are_candidates() {
        assert!(is_dra_socket_name("dra.sock"));
        assert!(is_dra_socket_name(
            "dra-0f5e3d1c-7b2a-4c9d-8e6f-1a2b3c4d5e6f.sock"
        ));
        assert!(!is_dra_socket_name("dra-.sock"));
        assert!(!is_dra_socket_name("serialize.lock"));
        assert!(!is_dra_socket_name("other.sock"));
        assert!(!is_dra_socket_name("dra-x.sock.tmp"));
    }

    #[test]
    fn the_newest_other_socket_comes_first_and_plain_files_never() {
        let dir = tempfile::tempdir().unwrap();
        let bind =
            |name: &str| std::os::unix::net::UnixListener::bind(dir.path().join(name)).unwrap();
        let own = dir.path().join("dra-own.sock");
        let _own = bind("dra-own.sock");
        let _old = bind("dra-old.sock");
        set_mtime(
            &dir.path().join("dra-old.sock"),
            SystemTime::now() - Duration::from_secs(60),
        );
        let _new = bind("dra-new.sock");
        std::fs::write(dir.path().join("dra-file.sock"), b"").unwrap();
        let names: Vec<_> = Successors::new(&own)
            .candidates()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["dra-new.sock", "dra-old.sock"]);
    }

    fn set_mtime(path: &Path, t: SystemTime) {
        let secs = t
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            .to_string();
        let status = std::process::Command::new("touch")
            .args(["-h", "-m", "-d", &format!("@{secs}")])
            .arg(path)
            .status()
            .unwrap();
        assert!(status.success());
    }
}
