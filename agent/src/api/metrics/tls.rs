//! TLS on the metrics listener (`[agent] metrics_tls`): the server's certificate, and,
//! with `client_ca_file`, client certificates required and checked against that CA
//! (mutual TLS), so that only scrapers holding a certificate the CA issued read the
//! metrics, and a bearer token, where one is also required, never crosses the network
//! in clear text.
//!
//! The files are read for each connection, as the token file is for each scrape: a
//! certificate renewed in place (cert-manager, a mounted Secret) applies to the next
//! connection without a restart. A scrape every few seconds makes that a few small file
//! reads and one parse per scrape.

use std::sync::Arc;

use rustls::{
    ServerConfig,
    crypto::{CryptoProvider, ring},
    server::WebPkiClientVerifier,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};

pub use crate::config::MetricsTls;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("metrics_tls.{field} {path}: {reason}")]
    File {
        field: &'static str,
        path: String,
        reason: String,
    },
    #[error("metrics_tls: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("metrics_tls.client_ca_file: {0}")]
    ClientCa(#[from] rustls::server::VerifierBuilderError),
}

fn file_err(field: &'static str, path: &std::path::Path, reason: impl ToString) -> TlsError {
    TlsError::File {
        field,
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn certs(
    field: &'static str,
    path: &std::path::Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_err(field, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(field, path, e))?;
    if certs.is_empty() {
        return Err(file_err(field, path, "no PEM certificate in it"));
    }
    Ok(certs)
}

/// A rustls server configuration from the files as they are now.
pub fn server_config(tls: &MetricsTls) -> Result<ServerConfig, TlsError> {
    let provider: Arc<CryptoProvider> = Arc::new(ring::default_provider());
    let chain = certs("cert_file", &tls.cert_file)?;
    let key = PrivateKeyDer::from_pem_file(&tls.key_file)
        .map_err(|e| file_err("key_file", &tls.key_file, e))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match &tls.client_ca_file {
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for ca in certs("client_ca_file", path)? {
                roots
                    .add(ca)
                    .map_err(|e| file_err("client_ca_file", path, e))?;
            }
            builder.with_client_cert_verifier(
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?,
            )
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}
