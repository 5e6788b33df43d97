//! `[fleet]`: instances that share their filters through Redis.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Fleet mode: instances that share their filters through Redis.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// Where Redis is (see [`RedisTarget::parse`]): `redis://[user:password@]host:port[/db]`
    /// for one server, `redis+cluster://[user:password@]host:port[,host:port...]` for a
    /// Redis Cluster (any of its nodes), `redis+sentinel://[user:password@]host:port[,...]/master[/db]`
    /// for a primary found through Sentinel; `rediss` in place of `redis` for TLS. The
    /// password is never logged.
    pub redis_url: String,
    /// A PEM file of the certificate authorities that sign the Redis servers'
    /// certificates (`rediss` only); default: the public web roots.
    #[serde(default)]
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// A PEM client certificate for Redis servers that ask for one (`tls-auth-clients`),
    /// with `tls_key_file`.
    #[serde(default)]
    pub tls_cert_file: Option<std::path::PathBuf>,
    /// The PEM private key of `tls_cert_file`.
    #[serde(default)]
    pub tls_key_file: Option<std::path::PathBuf>,
    /// The password of the Sentinels themselves (`requirepass` in their configuration),
    /// when they have one; the URL's credentials are the primary's.
    #[serde(default)]
    pub sentinel_password: Option<String>,
    /// Prefix of every key this fleet writes; fleets sharing one Redis need distinct ones.
    #[serde(default = "default_fleet_namespace")]
    pub namespace: String,
    /// This instance's name in leases and stream entries; default: the host name and a
    /// random suffix.
    #[serde(default)]
    pub instance_id: Option<String>,
    /// How long a builder's lease lasts without renewal; failover takes this plus one
    /// `retry_interval` at most.
    #[serde(default = "default_lease_ttl", with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// How often a builder renews its lease (well below `lease_ttl`).
    #[serde(default = "default_lease_renew", with = "humantime_serde")]
    pub lease_renew: Duration,
    /// How often a follower tries to take a free lease, checks the current generation
    /// and Redis's epoch, and how often an instance retries Redis after losing it.
    #[serde(default = "default_fleet_retry", with = "humantime_serde")]
    pub retry_interval: Duration,
    /// How long a superseded generation stays readable after a newer one is current.
    #[serde(default = "default_generation_grace", with = "humantime_serde")]
    pub generation_grace: Duration,
    /// Bytes per Redis string of a published snapshot.
    #[serde(default = "default_chunk_bytes")]
    pub chunk_bytes: usize,
    /// Once the change stream holds more entries than this past the current
    /// generation's start, the builder publishes a fresh generation so older ones can go.
    #[serde(default = "default_stream_max_entries")]
    pub stream_max_entries: u64,
    /// Timeout of one Redis command (blocking stream reads excepted).
    #[serde(default = "default_redis_timeout", with = "humantime_serde")]
    pub command_timeout: Duration,
}

fn default_fleet_namespace() -> String {
    "bloomgate".into()
}
fn default_lease_ttl() -> Duration {
    Duration::from_secs(10)
}
fn default_lease_renew() -> Duration {
    Duration::from_secs(3)
}
fn default_fleet_retry() -> Duration {
    Duration::from_secs(1)
}
fn default_generation_grace() -> Duration {
    Duration::from_secs(300)
}
fn default_chunk_bytes() -> usize {
    1 << 20
}
fn default_stream_max_entries() -> u64 {
    100_000
}
fn default_redis_timeout() -> Duration {
    Duration::from_secs(2)
}

/// The Redis deployment `redis_url` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One server (`redis://`, `rediss://`): the URL as given.
    Single(String),
    /// A Redis Cluster: `redis://` URLs of the nodes to start from, credentials in each.
    Cluster(Vec<String>),
    /// A primary found through Sentinel.
    Sentinel {
        /// `host:port` of each Sentinel.
        sentinels: Vec<(String, u16)>,
        /// The master name the Sentinels monitor.
        master: String,
        /// The database number on the primary.
        db: i64,
        /// Whether the primary and the Sentinels are reached over TLS.
        tls: bool,
        /// The primary's user name, if any.
        username: Option<String>,
        /// The primary's password, if any.
        password: Option<String>,
    },
}

impl RedisTarget {
    /// Reads `url`: `redis://` or `rediss://` for one server, `redis+cluster://` or
    /// `rediss+cluster://` with one or more comma-separated `host:port` for a cluster,
    /// `redis+sentinel://` or `rediss+sentinel://` with the Sentinels' `host:port` and
    /// `/master[/db]` for Sentinel. Credentials (`user:password@`) go before the hosts.
    ///
    /// # Errors
    ///
    /// What is wrong with the URL, in words.
    pub fn parse(url: &str) -> Result<RedisTarget, String> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(
                "must start with redis://, rediss://, redis+cluster:// or redis+sentinel://".into(),
            );
        };
        let (base, kind) = match scheme {
            "redis" | "rediss" => (scheme, None),
            "redis+cluster" => ("redis", Some(true)),
            "rediss+cluster" => ("rediss", Some(true)),
            "redis+sentinel" => ("redis", Some(false)),
            "rediss+sentinel" => ("rediss", Some(false)),
            _ => {
                return Err(format!(
                    "scheme {scheme:?}: use redis://, rediss:// (TLS), redis+cluster:// or redis+sentinel://"
                ));
            }
        };
        if rest.is_empty() {
            return Err("names no host".into());
        }
        let Some(cluster) = kind else {
            return Ok(RedisTarget::Single(url.to_owned()));
        };
        let (userinfo, rest) = match rest.rsplit_once('@') {
            Some((u, r)) => (Some(u), r),
            None => (None, rest),
        };
        let (hosts, path) = match rest.split_once('/') {
            Some((h, p)) => (h, Some(p)),
            None => (rest, None),
        };
        let mut addrs = Vec::new();
        for host in hosts.split(',') {
            let Some((h, p)) = host.rsplit_once(':') else {
                return Err(format!("{host:?} needs a port (host:port)"));
            };
            let port: u16 = p
                .parse()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| format!("{host:?} has no valid port"))?;
            if h.is_empty() {
                return Err(format!("{host:?} has no host name"));
            }
            addrs.push((h.to_owned(), port));
        }
        let (username, password) = match userinfo {
            None => (None, None),
            Some(u) => {
                let (user, pass) = match u.split_once(':') {
                    Some((a, b)) => (a, Some(b)),
                    None => (u, None),
                };
                let decode = |s: &str| {
                    percent_decode(s)
                        .ok_or_else(|| "bad percent-encoding in the credentials".to_owned())
                };
                (
                    Some(decode(user)?).filter(|u| !u.is_empty()),
                    pass.map(decode).transpose()?,
                )
            }
        };
        if cluster {
            if path.is_some_and(|p| !p.is_empty() && p != "0") {
                return Err("a cluster has only database 0: leave the path out".into());
            }
            let auth = match userinfo {
                Some(u) => format!("{u}@"),
                None => String::new(),
            };
            Ok(RedisTarget::Cluster(
                addrs
                    .iter()
                    .map(|(h, p)| format!("{base}://{auth}{h}:{p}"))
                    .collect(),
            ))
        } else {
            let mut parts = path.unwrap_or("").split('/');
            let master = parts.next().unwrap_or("");
            if master.is_empty() {
                return Err("names no master: add /MASTER_NAME after the Sentinels".into());
            }
            let db = match parts.next() {
                None | Some("") => 0,
                Some(d) => d
                    .parse()
                    .ok()
                    .filter(|d: &i64| *d >= 0)
                    .ok_or_else(|| format!("database {d:?} is not a number"))?,
            };
            if parts.next().is_some() {
                return Err("has more after /MASTER_NAME/DB".into());
            }
            Ok(RedisTarget::Sentinel {
                sentinels: addrs,
                master: master.to_owned(),
                db,
                tls: base == "rediss",
                username,
                password,
            })
        }
    }

    /// Whether the connections use TLS.
    pub fn tls(&self) -> bool {
        match self {
            RedisTarget::Single(url) => url.starts_with("rediss://"),
            RedisTarget::Cluster(nodes) => nodes.iter().any(|n| n.starts_with("rediss://")),
            RedisTarget::Sentinel { tls, .. } => *tls,
        }
    }

    /// `single`, `cluster` or `sentinel`, as the metrics and `/admin/fleet` name it.
    pub fn kind(&self) -> &'static str {
        match self {
            RedisTarget::Single(_) => "single",
            RedisTarget::Cluster(_) => "cluster",
            RedisTarget::Sentinel { .. } => "sentinel",
        }
    }
}

/// `%XX` sequences decoded; `None` for a broken one or bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::RedisTarget;

    #[test]
    fn the_three_kinds_of_url_are_read() {
        assert_eq!(
            RedisTarget::parse("redis://h:6379/2"),
            Ok(RedisTarget::Single("redis://h:6379/2".into()))
        );
        assert_eq!(
            RedisTarget::parse("rediss+cluster://u:p%40@a:7000,b:7001"),
            Ok(RedisTarget::Cluster(vec![
                "rediss://u:p%40@a:7000".into(),
                "rediss://u:p%40@b:7001".into()
            ]))
        );
        assert_eq!(
            RedisTarget::parse("redis+sentinel://:s%3Acret@s1:26379,s2:26380/mymaster/3"),
            Ok(RedisTarget::Sentinel {
                sentinels: vec![("s1".into(), 26379), ("s2".into(), 26380)],
                master: "mymaster".into(),
                db: 3,
                tls: false,
                username: None,
                password: Some("s:cret".into()),
            })
        );
    }

    #[test]
    fn malformed_urls_are_refused_with_a_reason() {
        for bad in [
            "",
            "redis:/h",
            "http://h:1",
            "redis+cluster://",
            "redis+cluster://h",
            "redis+cluster://h:0",
            "redis+cluster://h:99999",
            "redis+cluster://:7000",
            "redis+cluster://h:7000/1",
            "redis+sentinel://s:26379",
            "redis+sentinel://s:26379/",
            "redis+sentinel://s:26379/m/x",
            "redis+sentinel://s:26379/m/-1",
            "redis+sentinel://s:26379/m/0/extra",
            "redis+sentinel://u:%zz@s:26379/m",
            "redis+sentinel://s:26379,/m",
        ] {
            assert!(RedisTarget::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
