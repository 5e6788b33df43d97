//! TLS and HTTP/2 for the tests: a throwaway certificate authority that issues server
//! certificates (rcgen), written to files the way bloomgate reads them, and a client for
//! each way a request can reach the data plane (`Wire`): HTTP/1.1 and h2c (prior
//! knowledge) in cleartext, HTTP/1.1 and h2 (ALPN) over TLS trusting the test CA.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Version};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

use super::Reply;

/// A certificate authority for one test.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate, PEM.
    pub pem: String,
    der: rustls::pki_types::CertificateDer<'static>,
}

/// A server certificate for `localhost` and 127.0.0.1, with its chain and key.
pub struct Issued {
    /// The leaf, then the CA: what `cert_file` holds.
    pub chain_pem: String,
    /// The leaf's private key (PKCS#8): what `key_file` holds.
    pub key_pem: String,
    /// The leaf, DER: what a client sees first.
    pub leaf: Vec<u8>,
    /// The leaf's not-after time, Unix seconds.
    pub not_after: i64,
}

impl TestCa {
    /// A new CA with a fresh key.
    pub fn new() -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "bloomgate test CA");
        let key = KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("CA certificate");
        TestCa {
            pem: cert.pem(),
            der: cert.der().clone(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A certificate named `name` (in its common name) valid until midnight UTC of
    /// `year-month-day`.
    pub fn issue(&self, name: &str, (year, month, day): (i32, u8, u8)) -> Issued {
        let mut params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .expect("leaf params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(year, month, day);
        let key = KeyPair::generate().expect("leaf key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("leaf certificate");
        let not_after = chrono::NaiveDate::from_ymd_opt(year, month.into(), day.into())
            .expect("a date")
            .and_hms_opt(0, 0, 0)
            .expect("midnight")
            .and_utc()
            .timestamp();
        Issued {
            chain_pem: format!("{}{}", cert.pem(), self.pem),
            key_pem: key.serialize_pem(),
            leaf: cert.der().to_vec(),
            not_after,
        }
    }

    /// A client config trusting this CA, offering `alpn`.
    pub fn client_config(&self, alpn: &[&[u8]]) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        roots.add(self.der.clone()).expect("CA as a root");
        let mut config =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_root_certificates(roots)
                .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }
}

impl Issued {
    /// Writes `cert.pem` and `key.pem` into `dir`, each replaced whole (written beside,
    /// then renamed), as a certificate manager does; returns their paths.
    pub fn write(&self, dir: &Path) -> (PathBuf, PathBuf) {
        let cert = dir.join("cert.pem");
        let key = dir.join("key.pem");
        replace(&cert, self.chain_pem.as_bytes());
        replace(&key, self.key_pem.as_bytes());
        (cert, key)
    }
}

/// Replaces `path` whole with `bytes`.
pub fn replace(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).expect("write the new file");
    std::fs::rename(&tmp, path).expect("rename it into place");
}

/// The `[server]` line that turns TLS on with these files.
pub fn tls_line(cert: &Path, key: &Path) -> String {
    format!(
        "tls = {{ cert_file = {:?}, key_file = {:?} }}",
        cert.display().to_string(),
        key.display().to_string()
    )
}

/// How a request reaches the data plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// HTTP/1.1 in cleartext.
    Http1,
    /// HTTP/2 in cleartext, prior knowledge.
    H2c,
    /// HTTP/1.1 over TLS (ALPN `http/1.1`).
    Http1Tls,
    /// HTTP/2 over TLS (ALPN `h2`).
    H2Tls,
}

impl Wire {
    /// Whether TLS carries it.
    pub fn tls(self) -> bool {
        matches!(self, Wire::Http1Tls | Wire::H2Tls)
    }

    /// The HTTP version responses come in.
    pub fn version(self) -> Version {
        match self {
            Wire::Http1 | Wire::Http1Tls => Version::HTTP_11,
            Wire::H2c | Wire::H2Tls => Version::HTTP_2,
        }
    }

    /// Its `protocol` label in `bloomgate_connections_total`.
    pub fn label(self) -> &'static str {
        match self {
            Wire::Http1 | Wire::Http1Tls => "http1",
            Wire::H2c => "h2c",
            Wire::H2Tls => "h2",
        }
    }
}

/// Connects to a data plane at `addr` over one [`Wire`].
#[derive(Clone)]
pub struct WireClient {
    wire: Wire,
    addr: SocketAddr,
    tls: Option<Arc<ClientConfig>>,
}

/// One open connection.
pub struct WireConn {
    sender: Sender,
    wire: Wire,
    authority: String,
    /// The leaf certificate the server presented (TLS only).
    pub peer_certificate: Option<Vec<u8>>,
    /// The connection's task: its end, and how it ended.
    pub closed: tokio::task::JoinHandle<Result<(), hyper::Error>>,
}

enum Sender {
    H1(http1::SendRequest<Full<Bytes>>),
    H2(http2::SendRequest<Full<Bytes>>),
}

impl WireClient {
    /// A client for `wire`; TLS wires trust `ca`.
    pub fn new(wire: Wire, addr: SocketAddr, ca: Option<&TestCa>) -> WireClient {
        let tls = wire.tls().then(|| {
            let ca = ca.expect("a TLS wire needs the test CA");
            let alpn: &[&[u8]] = match wire {
                Wire::H2Tls => &[b"h2"],
                _ => &[b"http/1.1"],
            };
            ca.client_config(alpn)
        });
        WireClient { wire, addr, tls }
    }

    /// Its wire.
    pub fn wire(&self) -> Wire {
        self.wire
    }

    /// The address it connects to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Opens a connection (and the TLS session), failing the test if it cannot.
    pub async fn connect(&self) -> WireConn {
        self.try_connect()
            .await
            .unwrap_or_else(|e| panic!("{:?} connection to {}: {e}", self.wire, self.addr))
    }

    /// Opens a connection, or says why it could not.
    pub async fn try_connect(&self) -> Result<WireConn, String> {
        let tcp = TcpStream::connect(self.addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let authority = match self.wire.tls() {
            true => format!("localhost:{}", self.addr.port()),
            false => self.addr.to_string(),
        };
        let Some(config) = &self.tls else {
            let sender = self.handshake(TokioIo::new(tcp)).await?;
            return Ok(WireConn {
                sender: sender.0,
                wire: self.wire,
                authority,
                peer_certificate: None,
                closed: sender.1,
            });
        };
        let name = ServerName::try_from("localhost").map_err(|e| e.to_string())?;
        let stream = TlsConnector::from(Arc::clone(config))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake: {e}"))?;
        let session = stream.get_ref().1;
        let expected: &[u8] = match self.wire {
            Wire::H2Tls => b"h2",
            _ => b"http/1.1",
        };
        if session.alpn_protocol() != Some(expected) {
            return Err(format!(
                "ALPN chose {:?}",
                session.alpn_protocol().map(String::from_utf8_lossy)
            ));
        }
        let peer_certificate = session
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|c| c.to_vec());
        let (sender, closed) = self.handshake(TokioIo::new(stream)).await?;
        Ok(WireConn {
            sender,
            wire: self.wire,
            authority,
            peer_certificate,
            closed,
        })
    }

    async fn handshake<I>(
        &self,
        io: I,
    ) -> Result<(Sender, tokio::task::JoinHandle<Result<(), hyper::Error>>), String>
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        match self.wire {
            Wire::Http1 | Wire::Http1Tls => {
                let (sender, conn) = http1::handshake(io)
                    .await
                    .map_err(|e| format!("HTTP/1.1 handshake: {e}"))?;
                Ok((Sender::H1(sender), tokio::spawn(conn)))
            }
            Wire::H2c | Wire::H2Tls => {
                let (sender, conn) = http2::handshake(TokioExecutor::new(), io)
                    .await
                    .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
                Ok((Sender::H2(sender), tokio::spawn(conn)))
            }
        }
    }

    /// One request on a connection of its own.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (Version, Reply) {
        self.connect().await.send(method, path, headers, body).await
    }

    /// A GET on a connection of its own.
    pub async fn get(&self, path: &str) -> (Version, Reply) {
        self.send(Method::GET, path, &[], "").await
    }
}

impl WireConn {
    /// Sends one request on this connection and reads the whole answer.
    pub async fn send(
        &mut self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (Version, Reply) {
        self.try_send(method, path, headers, body)
            .await
            .unwrap_or_else(|e| panic!("{:?} request {path}: {e}", self.wire))
    }

    /// As [`WireConn::send`], saying why it failed instead of failing the test.
    pub async fn try_send(
        &mut self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<(Version, Reply), String> {
        let scheme = if self.wire.tls() { "https" } else { "http" };
        let mut req = match &self.sender {
            // HTTP/1.1: origin form and a Host header.
            Sender::H1(_) => Request::builder()
                .uri(path)
                .header("host", self.authority.as_str()),
            // HTTP/2: the authority goes in `:authority`, with no Host header.
            Sender::H2(_) => Request::builder().uri(format!("{scheme}://{}{path}", self.authority)),
        }
        .method(method);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req
            .body(Full::new(Bytes::from(body.to_owned())))
            .map_err(|e| e.to_string())?;
        let sent = async {
            match &mut self.sender {
                Sender::H1(s) => {
                    s.ready().await?;
                    s.send_request(req).await
                }
                Sender::H2(s) => {
                    s.ready().await?;
                    s.send_request(req).await
                }
            }
        };
        let resp = tokio::time::timeout(Duration::from_secs(30), sent)
            .await
            .map_err(|_| "no answer in 30 s".to_owned())?
            .map_err(|e| e.to_string())?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok((
            parts.version,
            Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            },
        ))
    }
}

/// Headers that describe one connection and are never sent in an HTTP/2 response
/// (RFC 9113 §8.2.2).
pub const CONNECTION_HEADERS: [&str; 5] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
];

/// The connection-specific headers present in `headers`.
pub fn connection_headers(headers: &HeaderMap) -> Vec<&'static str> {
    CONNECTION_HEADERS
        .into_iter()
        .filter(|h| headers.contains_key(*h))
        .collect()
}
