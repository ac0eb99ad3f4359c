//! What the kubelet plugin publishes of each device in its ResourceSlice, and the limits
//! resource.k8s.io puts on a slice (Kubernetes 1.34–1.36), so that the agent's config
//! refuses at start what the API server would refuse when the slice is published.

/// Attributes of every device, in the driver's domain.
pub const DEVICE_ATTRIBUTES: [&str; 3] = ["kind", "mechanism", "enforced"];
/// Attributes a GPU adds.
pub const GPU_ATTRIBUTES: [&str; 2] = ["uuid", "model"];
/// `ResourceSliceMaxAttributesAndCapacitiesPerDevice`.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// `ResourceSliceMaxDevices`: the plugin publishes a pool as one slice.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// `DeviceAttributeMaxValueLength`, for string attributes.
pub const MAX_STRING_ATTRIBUTE: usize = 64;
/// `CapacityRequestPolicyDiscreteMaxOptions`.
pub const MAX_VALID_VALUES: usize = 10;

/// How many attributes the plugin publishes for a device of this kind.
pub fn attributes_for(kind_is_gpu: bool) -> usize {
    DEVICE_ATTRIBUTES.len() + if kind_is_gpu { GPU_ATTRIBUTES.len() } else { 0 }
}
