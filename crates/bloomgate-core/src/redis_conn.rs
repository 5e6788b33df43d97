//! The connection to the fleet's Redis, whichever kind `fleet.redis_url` names: one
//! server, a Redis Cluster, or a primary found through Sentinel. [`RedisConn`] is a
//! cloneable multiplexed handle that every fleet and Redis-held gate call goes through;
//! none of them connects up front, so an instance starts while Redis is down.
//!
//! - One server: redis's connection manager, which reconnects on its own.
//! - Cluster: redis's cluster client, which routes each command by its key's slot and
//!   follows `MOVED` and `ASK` when slots move or a replica is promoted. Its first
//!   connection is made at the first command, and made again after a command finds it
//!   unusable.
//! - Sentinel: the primary's address is asked of the Sentinels (the first that answers,
//!   and only an answer whose node says it is a primary), and asked again whenever a
//!   command fails on the connection or is refused as `READONLY` (the old primary came
//!   back as a replica).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, ClientTlsConfig, Cmd, ConnectionAddr, ErrorKind, Pipeline, RedisError,
    RedisFuture, ServerErrorKind, TlsCertificates, TlsMode, Value,
};

use crate::config::{FleetConfig, RedisTarget};

/// Why the Redis connection could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL or the client settings were refused.
    #[error("redis")]
    Redis(#[from] RedisError),
    /// `fleet.redis_url` is not one of the forms bloomgate reads.
    #[error("fleet.redis_url: {0}")]
    Url(String),
    /// A TLS file named in `[fleet]` could not be read.
    #[error("cannot read {field} {path}")]
    File {
        /// The setting.
        field: &'static str,
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Timeouts of one connection.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Connecting, TLS included.
    pub connect: Duration,
    /// Waiting for one reply.
    pub response: Duration,
    /// The longest wait between reconnection attempts (one server).
    pub retry: Duration,
}

/// A handle on the fleet's Redis; clones share the connection.
#[derive(Clone)]
pub enum RedisConn {
    /// One server.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(Arc<Lazy<ClusterConnection, redis::cluster::ClusterClient>>),
    /// A primary behind Sentinel.
    Sentinel(Arc<Lazy<MultiplexedConnection, SentinelSource>>),
}

impl RedisConn {
    /// A handle on what `config.redis_url` names, with `timeouts`; connects lazily.
    ///
    /// # Errors
    ///
    /// [`ConnectError`] for a URL, a setting or a TLS file that cannot be used.
    pub fn open(config: &FleetConfig, timeouts: Timeouts) -> Result<RedisConn, ConnectError> {
        let target = RedisTarget::parse(&config.redis_url).map_err(ConnectError::Url)?;
        let certs = certificates(config)?;
        match target {
            RedisTarget::Single(url) => {
                let client = match certs {
                    Some(certs) => redis::Client::build_with_tls(url.as_str(), certs)?,
                    None => redis::Client::open(url.as_str())?,
                };
                let settings = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeouts.connect))
                    .set_response_timeout(Some(timeouts.response))
                    .set_number_of_retries(2)
                    .set_max_delay(timeouts.retry);
                Ok(RedisConn::Single(ConnectionManager::new_lazy_with_config(
                    client, settings,
                )?))
            }
            RedisTarget::Cluster(nodes) => {
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes)
                    .connection_timeout(timeouts.connect)
                    .response_timeout(timeouts.response)
                    .retries(3)
                    .min_retry_wait(50)
                    .max_retry_wait(timeouts.retry.as_millis().max(100) as u64);
                if let Some(certs) = certs {
                    builder = builder.certs(certs);
                }
                Ok(RedisConn::Cluster(Arc::new(Lazy::new(builder.build()?))))
            }
            RedisTarget::Sentinel {
                sentinels,
                master,
                db,
                tls,
                username,
                password,
            } => {
                let addrs = sentinels.into_iter().map(|(host, port)| {
                    if tls {
                        ConnectionAddr::TcpTls {
                            host,
                            port,
                            insecure: false,
                            tls_params: None,
                        }
                    } else {
                        ConnectionAddr::Tcp(host, port)
                    }
                });
                let mut builder =
                    SentinelClientBuilder::new(addrs, &master, SentinelServerType::Master)?
                        .set_client_to_redis_db(db);
                if tls {
                    builder = builder
                        .set_client_to_redis_tls_mode(TlsMode::Secure)
                        .set_client_to_sentinel_tls_mode(TlsMode::Secure);
                }
                if let Some(certs) = certs {
                    builder = builder
                        .set_client_to_redis_certificates(certs.clone())
                        .set_client_to_sentinel_certificates(certs);
                }
                if let Some(user) = username {
                    builder = builder.set_client_to_redis_username(user);
                }
                if let Some(pass) = password {
                    builder = builder.set_client_to_redis_password(pass);
                }
                if let Some(pass) = &config.sentinel_password {
                    builder = builder.set_client_to_sentinel_password(pass);
                }
                let source = SentinelSource {
                    client: tokio::sync::Mutex::new(builder.build()?),
                    config: AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(timeouts.connect))
                        .set_response_timeout(Some(timeouts.response)),
                };
                Ok(RedisConn::Sentinel(Arc::new(Lazy::new(source))))
            }
        }
    }
}

/// The CA and client certificate named in `[fleet]`, if any.
fn certificates(config: &FleetConfig) -> Result<Option<TlsCertificates>, ConnectError> {
    let read = |field: &'static str, path: &Path| {
        std::fs::read(path).map_err(|source| ConnectError::File {
            field,
            path: path.display().to_string(),
            source,
        })
    };
    let root_cert = config
        .tls_ca_file
        .as_deref()
        .map(|p| read("fleet.tls_ca_file", p))
        .transpose()?;
    let client_tls = match (&config.tls_cert_file, &config.tls_key_file) {
        (Some(cert), Some(key)) => Some(ClientTlsConfig {
            client_cert: read("fleet.tls_cert_file", cert)?,
            client_key: read("fleet.tls_key_file", key)?,
        }),
        _ => None,
    };
    if root_cert.is_none() && client_tls.is_none() {
        return Ok(None);
    }
    Ok(Some(TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// How a [`Lazy`] makes its connection.
pub trait Connector: Send + Sync + 'static {
    /// The connection made.
    type Conn: ConnectionLike + Clone + Send + Sync + 'static;
    /// Makes one.
    fn connect(&self) -> impl std::future::Future<Output = Result<Self::Conn, RedisError>> + Send;
}

impl Connector for redis::cluster::ClusterClient {
    type Conn = ClusterConnection;
    async fn connect(&self) -> Result<ClusterConnection, RedisError> {
        self.get_async_connection().await
    }
}

/// Finds the primary through the Sentinels.
pub struct SentinelSource {
    client: tokio::sync::Mutex<SentinelClient>,
    config: AsyncConnectionConfig,
}

impl Connector for SentinelSource {
    type Conn = MultiplexedConnection;
    async fn connect(&self) -> Result<MultiplexedConnection, RedisError> {
        let mut client = self.client.lock().await;
        client.get_async_connection_with_config(&self.config).await
    }
}

/// A connection made at its first use and made again after a failure says it is
/// unusable.
pub struct Lazy<C: ConnectionLike + Clone, S> {
    conn: ArcSwapOption<C>,
    /// Held while connecting, so that one connection is made at a time.
    connecting: tokio::sync::Mutex<()>,
    source: S,
}

impl<S: Connector> Lazy<S::Conn, S> {
    fn new(source: S) -> Self {
        Lazy {
            conn: ArcSwapOption::empty(),
            connecting: tokio::sync::Mutex::new(()),
            source,
        }
    }

    /// The connection, made now if there is none.
    async fn get(&self) -> Result<S::Conn, RedisError> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _one = self.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let conn = self.source.connect().await?;
        self.conn.store(Some(Arc::new(conn.clone())));
        Ok(conn)
    }

    /// A clone of the connection there is, read without touching the `Arc`'s count.
    fn current(&self) -> Option<S::Conn> {
        self.conn.load().as_deref().cloned()
    }

    /// Drops the connection if `error` says it no longer leads to a usable primary.
    fn judge<T>(&self, result: Result<T, RedisError>) -> Result<T, RedisError> {
        if let Err(e) = &result
            && unusable(e)
        {
            self.conn.store(None);
        }
        result
    }
}

/// Whether `e` means the connection should be made again (to the primary as it is now).
fn unusable(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(lazy) => Box::pin(command(lazy, cmd)),
            RedisConn::Sentinel(lazy) => Box::pin(command(lazy, cmd)),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(lazy) => Box::pin(commands(lazy, pipeline, offset, count)),
            RedisConn::Sentinel(lazy) => Box::pin(commands(lazy, pipeline, offset, count)),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(_) => 0,
            RedisConn::Sentinel(lazy) => lazy.conn.load().as_ref().map_or(0, |c| c.get_db()),
        }
    }
}

async fn command<S: Connector>(lazy: &Lazy<S::Conn, S>, cmd: &Cmd) -> Result<Value, RedisError> {
    let mut conn = lazy.get().await?;
    let result = conn.req_packed_command(cmd).await;
    lazy.judge(result)
}

async fn commands<S: Connector>(
    lazy: &Lazy<S::Conn, S>,
    pipeline: &Pipeline,
    offset: usize,
    count: usize,
) -> Result<Vec<Value>, RedisError> {
    let mut conn = lazy.get().await?;
    let result = conn.req_packed_commands(pipeline, offset, count).await;
    lazy.judge(result)
}
