//! What a driver answers kubelet for each claim, and who asked: shared by the driver
//! that decides, the kubelet API that translates, and the forwarding of a fenced
//! instance's calls.

/// One device of a prepared claim, as kubelet gets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceAnswer {
    /// The claim's request as a container names it (`resources.claims[].request`): the
    /// parent request of a `firstAvailable` subrequest, since kubelet matches the names
    /// exactly.
    pub request: String,
    pub pool: String,
    pub device: String,
    /// None for a whole device.
    pub share_id: Option<String>,
    pub cdi_device_ids: Vec<String>,
}

/// Where a call came from: kubelet, or a fenced instance that passed it on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    Kubelet,
    /// Never passed on again.
    FencedInstance,
}

/// Claim uid (kubelet's key) -> the answer for it.
pub type Answers<T> = Vec<(String, Result<T, String>)>;
