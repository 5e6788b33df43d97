//! TLS termination for the data plane: a rustls server config (the ring provider that the
//! database and Redis clients use too; TLS 1.2 and 1.3; ALPN `h2` and `http/1.1`) whose
//! certificate is read per handshake from a swappable slot. A reload swaps the slot: new
//! handshakes get the new certificate, established connections keep their session. It
//! does not read HTTP.

use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{self, ServerConfig};

use super::metrics::ConnectionMetrics;
use bloomgate_core::cert::{CertificateError, CertificateFiles, LoadedCertificate, provider};
use bloomgate_core::report::Chain;

/// The ALPN name of HTTP/2.
pub const ALPN_H2: &[u8] = b"h2";
/// The ALPN name of HTTP/1.1.
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

/// Why the TLS server config could not be made.
#[derive(Debug, thiserror::Error)]
#[error("cannot set up TLS")]
pub struct TlsSetupError(#[from] rustls::Error);

/// The data plane's TLS: the acceptor every handshake goes through and the certificate
/// slot it reads.
pub struct Tls {
    acceptor: TlsAcceptor,
    slot: Arc<CertificateSlot>,
    /// Changed by [`Tls::install`] when a reload names other files.
    files: std::sync::Mutex<CertificateFiles>,
    metrics: Option<ConnectionMetrics>,
}

/// The certificate new handshakes get.
#[derive(Debug)]
struct CertificateSlot(ArcSwap<CertifiedKey>);

impl ResolvesServerCert for CertificateSlot {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

impl Tls {
    /// TLS with `first` (loaded from `files`) as the certificate, offering HTTP/2 by ALPN
    /// when `http2`. `metrics` learn the certificate's expiry and count reloads.
    pub fn new(
        files: CertificateFiles,
        first: LoadedCertificate,
        http2: bool,
        metrics: Option<ConnectionMetrics>,
    ) -> Result<Tls, TlsSetupError> {
        let slot = Arc::new(CertificateSlot(ArcSwap::new(first.key)));
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(&slot) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = if http2 {
            vec![ALPN_H2.to_vec(), ALPN_HTTP1.to_vec()]
        } else {
            vec![ALPN_HTTP1.to_vec()]
        };
        if let Some(m) = &metrics {
            m.certificate_expires(first.not_after);
        }
        Ok(Tls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            slot,
            files: std::sync::Mutex::new(files),
            metrics,
        })
    }

    /// Serves `loaded`, read from `files` by a configuration reload, to new handshakes,
    /// and reads `files` on later reloads.
    pub fn install(&self, files: CertificateFiles, loaded: LoadedCertificate) {
        self.slot.0.store(Arc::clone(&loaded.key));
        if let Some(m) = &self.metrics {
            m.certificate_expires(loaded.not_after);
            m.reloaded(true);
        }
        tracing::info!(cert_file = %files.cert_file.display(), not_after = loaded.not_after,
            "TLS certificate reloaded");
        *self.files.lock().unwrap_or_else(|p| p.into_inner()) = files;
    }

    /// The acceptor for new connections.
    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// Reads the files again. On success new handshakes get the new certificate; on
    /// failure the current one stays. Either way it is logged and counted.
    pub fn reload(&self) -> Result<(), CertificateError> {
        let files = self.files.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let result = files.load();
        match &result {
            Ok(loaded) => {
                self.slot.0.store(Arc::clone(&loaded.key));
                if let Some(m) = &self.metrics {
                    m.certificate_expires(loaded.not_after);
                }
                tracing::info!(
                    cert_file = %files.cert_file.display(),
                    not_after = loaded.not_after,
                    "TLS certificate reloaded"
                );
            }
            Err(e) => {
                tracing::error!(
                    cert_file = %files.cert_file.display(),
                    key_file = %files.key_file.display(),
                    error = %Chain(e),
                    "TLS certificate reload failed; the current certificate stays"
                );
            }
        }
        if let Some(m) = &self.metrics {
            m.reloaded(result.is_ok());
        }
        result.map(|_| ())
    }
}
