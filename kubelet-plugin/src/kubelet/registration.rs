//! The `pluginregistration.Registration` service on `<registry-dir>/<driver>/reg.sock`.

use shareguard_proto::kubelet::pluginregistration::{
    self as reg, registration_server::Registration as RegistrationService,
};
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{error, info};

use super::{PLUGIN_TYPE, SUPPORTED_VERSIONS};

/// What kubelet last said about the registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistrationState {
    /// kubelet has not answered yet.
    Waiting,
    Registered,
    Refused(String),
}

pub struct Registration {
    driver: String,
    endpoint: String,
    state: watch::Sender<RegistrationState>,
}

impl Registration {
    /// `endpoint` is the DRA socket kubelet is to call.
    pub fn new(driver: &str, endpoint: &str) -> (Self, watch::Receiver<RegistrationState>) {
        let (tx, rx) = watch::channel(RegistrationState::Waiting);
        (
            Self {
                driver: driver.to_owned(),
                endpoint: endpoint.to_owned(),
                state: tx,
            },
            rx,
        )
    }
}

#[tonic::async_trait]
impl RegistrationService for Registration {
    async fn get_info(
        &self,
        _req: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: PLUGIN_TYPE.to_owned(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| (*v).to_owned()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let s = req.into_inner();
        let state = if s.plugin_registered {
            info!(driver = %self.driver, "kubelet registered the plugin");
            RegistrationState::Registered
        } else {
            error!(driver = %self.driver, error = %s.error, "kubelet refused the plugin");
            RegistrationState::Refused(s.error)
        };
        self.state.send_replace(state);
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}
