//! Compiling: a config becomes the runtime forms the app wires — route patterns, query
//! rules, header names and statuses, filter sizes, address ranges, the upstream's
//! authority — each made once, by the same step that checks it, together with the rules
//! of `validate`. [`Config::compile`] is the one entry; `App` takes its [`Compiled`] and
//! re-checks nothing. It opens nothing: no socket, pool or client.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use http::uri::Authority;
use http::{HeaderName, HeaderValue, Method, StatusCode};

use super::source::{BinlogSource, SourceTable};
use super::validate::Problems;
use super::{
    Config, ConfigError, FilterConfig, KeySource, Normalize, OriginConfig, RouteConfig, RouteMode,
    StaleWindows, TlsConfig, UndeclaredQuery, UpstreamConfig, WatermarkKind, WriteKey,
    WriteThroughConfig,
};
use crate::cert::CertificateFiles;
use crate::cert::{CertFile, LoadedCertificate};
use crate::filter::BloomParams;
use crate::pattern::cidrs::Cidrs;
use crate::pattern::route::{MatchOptions, PathPattern, QueryRules};
use crate::report::Chain;

mod forwarding;
use forwarding::compile_forwarding;

/// A config that passed every rule, and everything decided from it. Only
/// [`Config::compile`] makes one, so what it holds is consistent: every route's and
/// write-through rule's filter is in [`Compiled::filters`], every upstream origin has
/// [`Compiled::upstream`], every sql origin has `[database]`. Its fields are open to
/// the stages that take it apart; `non_exhaustive` keeps anything outside this crate
/// from putting one together.
#[derive(Debug)]
#[non_exhaustive]
pub struct Compiled {
    /// The config it was compiled from.
    pub config: Config,
    /// `[upstream]`, when configured.
    pub upstream: Option<CompiledUpstream>,
    /// The filters, in name order.
    pub filters: Vec<CompiledFilter>,
    /// The guarded routes, in match order.
    pub routes: Vec<CompiledRoute>,
    /// The write-through rules, in match order.
    pub write_through: Vec<CompiledWriteThrough>,
    /// `server.trusted_proxies`.
    pub trusted_proxies: Cidrs,
    /// `server.outcome_header_clients`.
    pub outcome_header_clients: Cidrs,
    /// `[server.tls]` with its certificate read, when configured.
    pub tls: Option<CompiledTls>,
}

impl Compiled {
    /// The config it was compiled from.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The config it was compiled from, given back.
    pub fn into_config(self) -> Config {
        self.config
    }

    /// `[upstream]`, when configured.
    pub fn upstream(&self) -> Option<&CompiledUpstream> {
        self.upstream.as_ref()
    }

    /// The filters, in name order; routes and write-through rules refer to them by
    /// position.
    pub fn filters(&self) -> &[CompiledFilter] {
        &self.filters
    }

    /// The guarded routes, in match order.
    pub fn routes(&self) -> &[CompiledRoute] {
        &self.routes
    }

    /// The write-through rules, in match order.
    pub fn write_through(&self) -> &[CompiledWriteThrough] {
        &self.write_through
    }

    /// `server.trusted_proxies`.
    pub fn trusted_proxies(&self) -> &Cidrs {
        &self.trusted_proxies
    }

    /// `server.outcome_header_clients`.
    pub fn outcome_header_clients(&self) -> &Cidrs {
        &self.outcome_header_clients
    }

    /// `[server.tls]` with its certificate read, when configured.
    pub fn tls(&self) -> Option<&CompiledTls> {
        self.tls.as_ref()
    }
}

/// `[server.tls]` with its files read and checked against each other.
#[derive(Debug, Clone)]
pub struct CompiledTls {
    /// Where the certificate was read from (and is read again on reload).
    pub files: CertificateFiles,
    /// The certificate and key as read.
    pub certificate: LoadedCertificate,
}

/// Reads the files of `[server.tls]`; a problem names the file's field.
fn compile_tls(tls: &TlsConfig, p: &mut Problems) -> Option<CompiledTls> {
    let files = CertificateFiles {
        cert_file: tls.cert_file.clone(),
        key_file: tls.key_file.clone(),
    };
    match files.load() {
        Ok(certificate) => Some(CompiledTls { files, certificate }),
        Err(e) => {
            let field = match e.file() {
                CertFile::Cert => "server.tls.cert_file",
                CertFile::Key => "server.tls.key_file",
            };
            p.add(field, Chain(&e));
            None
        }
    }
}

/// `[upstream]` with its URL read.
#[derive(Debug, Clone)]
pub struct CompiledUpstream {
    /// The section as written.
    pub settings: UpstreamConfig,
    /// `host:port` of `upstream.url` (its scheme is `http`, its path empty).
    pub authority: Authority,
}

/// One filter with its size.
#[derive(Debug, Clone)]
pub struct CompiledFilter {
    /// Its name in `[filters]`.
    pub name: String,
    /// The section as written.
    pub settings: FilterConfig,
    /// `BloomParams::optimal` of `expected_items` and `false_positive_rate`: the size of
    /// a build that finds no more keys than expected.
    pub params: BloomParams,
    /// In binlog mode, the table and key column `source_query` scans, and the
    /// replication URL.
    pub binlog: Option<BinlogSource>,
}

/// One guarded route, ready to match requests.
#[derive(Debug, Clone)]
pub struct CompiledRoute {
    /// Position in `routes`, part of cache keys.
    pub id: u16,
    /// Name for metric labels and logs.
    pub label: Arc<str>,
    /// Path pattern and key source.
    pub pattern: PathPattern,
    /// Which query parameters are read, forwarded or refused.
    pub query: QueryRules,
    /// The key normaliser (the filter's).
    pub normalize: Normalize,
    /// Position of its filter in [`Compiled::filters`].
    pub filter: usize,
    /// Enforce, shadow or off.
    pub mode: RouteMode,
    /// Positive TTL (the route's, else `cache.ttl`).
    pub ttl: Duration,
    /// Negative TTL (the route's, else `cache.negative_ttl`).
    pub negative_ttl: Duration,
    /// How long past its TTL an entry may be served (the route's, else the cache's).
    pub stale: StaleWindows,
    /// Where found keys are fetched from.
    pub origin: CompiledOrigin,
}

impl CompiledRoute {
    /// Whether answers differ by forwarded query parameters or headers, so cache keys
    /// carry a variant.
    pub fn has_variants(&self) -> bool {
        !self.query.forward.is_empty()
            || matches!(&self.origin, CompiledOrigin::Upstream { forward_headers, .. } if !forward_headers.is_empty())
    }
}

/// A route's origin, ready to ask.
#[derive(Debug, Clone)]
pub enum CompiledOrigin {
    /// A query against `[database]`.
    Sql {
        /// The lookup, with one `?` for the key.
        query: Arc<str>,
        /// Longest time a lookup may take.
        timeout: Duration,
    },
    /// A request to `[upstream]`.
    Upstream {
        /// Statuses meaning "no such key".
        not_found: Vec<StatusCode>,
        /// Request headers forwarded (lower case).
        forward_headers: Vec<HeaderName>,
        /// Headers set on every request.
        headers: Vec<(HeaderName, HeaderValue)>,
    },
}

/// One write-through rule, ready to match writes.
#[derive(Debug, Clone)]
pub struct CompiledWriteThrough {
    /// Path pattern of the write.
    pub pattern: PathPattern,
    /// Methods that count as writes (upper case).
    pub methods: Vec<Method>,
    /// Upstream statuses meaning success; empty means any 2xx.
    pub statuses: Vec<StatusCode>,
    /// Where the new key is read from.
    pub key: WriteKey,
    /// Position of its filter in [`Compiled::filters`].
    pub filter: usize,
}

impl Config {
    /// Checks every rule and compiles the runtime forms. The error lists every broken
    /// rule, each naming its field, in file order.
    pub fn compile(&self) -> Result<Compiled, ConfigError> {
        let mut p = Problems::default();
        self.check_server(&mut p);
        let tls = self
            .server
            .tls
            .as_ref()
            .and_then(|t| compile_tls(t, &mut p));
        let trusted_proxies = p
            .check(
                "server.trusted_proxies",
                Cidrs::parse(&self.server.trusted_proxies),
            )
            .unwrap_or_default();
        let outcome_header_clients = p
            .check(
                "server.outcome_header_clients",
                Cidrs::parse(&self.server.outcome_header_clients),
            )
            .unwrap_or_default();
        let admin_token = self.check_admin(&mut p);
        let upstream = self.upstream.as_ref().and_then(|settings| {
            let authority = p.check(
                "upstream.url",
                upstream_authority(&settings.url).map_err(|e| Chain(&e).to_string()),
            )?;
            Some(CompiledUpstream {
                settings: settings.clone(),
                authority,
            })
        });
        self.check_backends(&mut p);
        self.check_cache(&mut p);
        let mut filters = Vec::with_capacity(self.filters.len());
        for (name, f) in &self.filters {
            super::validate::check_filter(name, f, &mut p);
            let binlog = self.binlog_source(name, f, &mut p);
            if let Some(params) = filter_params(name, f, &mut p) {
                filters.push(CompiledFilter {
                    name: name.clone(),
                    settings: f.clone(),
                    params,
                    binlog,
                });
            }
        }
        let positions: BTreeMap<&str, usize> = self
            .filters
            .keys()
            .enumerate()
            .map(|(i, name)| (name.as_str(), i))
            .collect();
        let mut routes = Vec::with_capacity(self.routes.len());
        let mut labels = HashSet::new();
        for (i, r) in self.routes.iter().enumerate() {
            let Ok(id) = u16::try_from(i) else {
                p.add(
                    "routes",
                    format!("at most {} routes", usize::from(u16::MAX) + 1),
                );
                break;
            };
            routes.extend(self.compile_route(id, r, &positions, &mut labels, &mut p));
        }
        let mut write_through = Vec::with_capacity(self.write_through.len());
        for (i, w) in self.write_through.iter().enumerate() {
            write_through.extend(compile_write_through(i, w, &positions, &mut p));
        }
        self.check_budget(&mut p);
        self.check_fleet(&mut p);
        self.check_audit(&mut p);
        // Every part that failed to compile left a problem, so with none, all are here.
        p.into_result()?;
        let mut config = self.clone();
        // The token in force, wherever it came from, in the one field the app reads.
        config.admin.token = admin_token;
        config.admin.token_file = None;
        Ok(Compiled {
            config,
            upstream,
            filters,
            routes,
            write_through,
            trusted_proxies,
            outcome_header_clients,
            tls,
        })
    }

    fn compile_route(
        &self,
        id: u16,
        r: &RouteConfig,
        filters: &BTreeMap<&str, usize>,
        labels: &mut HashSet<String>,
        p: &mut Problems,
    ) -> Option<CompiledRoute> {
        let at = |field: &str| format!("routes[{id}].{field}");
        let before = p.len();
        let pattern = p.check(
            at("path"),
            PathPattern::parse(&r.path, &r.key, MatchOptions::of(r)),
        );
        let forwarding = compile_forwarding(r, &at, p);
        if !labels.insert(r.label().to_owned()) {
            p.add(
                at("name"),
                format!("route name `{}` is used twice", r.label()),
            );
        }
        let filter = match filters.get(r.filter.as_str()) {
            None => {
                p.add(
                    at("filter"),
                    format!("no filter named `{}` in [filters]", r.filter),
                );
                None
            }
            Some(&filter) => {
                if let Some(n) = &r.normalize
                    && self
                        .filters
                        .get(&r.filter)
                        .is_some_and(|f| &f.normalize != n)
                {
                    p.add(
                        at("normalize"),
                        format!(
                            "must match filters.{}.normalize, or the loader and the route would disagree on keys",
                            r.filter
                        ),
                    );
                }
                Some(filter)
            }
        };
        let origin = match &r.origin {
            OriginConfig::Sql { query, timeout } => {
                let marks = query.matches('?').count();
                if query.trim().is_empty() {
                    p.add(at("origin.query"), "must not be empty");
                } else if marks != 1 {
                    p.add(
                        at("origin.query"),
                        format!("needs exactly one `?` placeholder for the key, found {marks}"),
                    );
                }
                if timeout.is_zero() {
                    p.add(at("origin.timeout"), "must be greater than 0");
                }
                CompiledOrigin::Sql {
                    query: Arc::from(query.as_str()),
                    timeout: *timeout,
                }
            }
            OriginConfig::Upstream { not_found_statuses } => CompiledOrigin::Upstream {
                not_found: not_found_statuses
                    .iter()
                    .filter_map(|&s| p.check(at("origin.not_found_statuses"), status(s)))
                    .collect(),
                forward_headers: forwarding.headers,
                headers: forwarding.set,
            },
        };
        for (field, ttl) in [("ttl", r.ttl), ("negative_ttl", r.negative_ttl)] {
            if ttl.is_some_and(|t| t.is_zero()) {
                p.add(at(field), "must be greater than 0");
            }
        }
        if p.len() > before {
            return None;
        }
        Some(CompiledRoute {
            id,
            label: Arc::from(r.label()),
            pattern: pattern?,
            query: QueryRules {
                key: match &r.key {
                    KeySource::Query(name) => Some(name.clone()),
                    KeySource::Segment(_) => None,
                },
                forward: r.forward_query.clone(),
                reject_undeclared: r.undeclared_query == UndeclaredQuery::Reject,
            },
            normalize: self.route_normalize(r),
            filter: filter?,
            mode: r.mode,
            ttl: r.ttl.unwrap_or(self.cache.ttl),
            negative_ttl: r.negative_ttl.unwrap_or(self.cache.negative_ttl),
            stale: StaleWindows {
                if_error: r.stale_if_error.unwrap_or(self.cache.stale_if_error),
                while_revalidate: r
                    .stale_while_revalidate
                    .unwrap_or(self.cache.stale_while_revalidate),
            },
            origin,
        })
    }
}

impl Config {
    /// In binlog mode, what `source_query` scans; a problem when it is not a plain scan
    /// of one table, or when the database is not MySQL or MariaDB (SQLite has no binary
    /// log). `None` in the other modes.
    fn binlog_source(
        &self,
        name: &str,
        f: &FilterConfig,
        p: &mut Problems,
    ) -> Option<BinlogSource> {
        let sync = f.sync.as_ref()?;
        if sync.watermark != WatermarkKind::Binlog {
            return None;
        }
        let database = self.database.as_ref().map_or("", |d| d.url.as_str());
        let mysql = |url: &str| url.starts_with("mysql:") || url.starts_with("mariadb:");
        if !mysql(database) {
            p.add(
                format!("filters.{name}.sync.watermark"),
                "binlog mode needs a MySQL or MariaDB database (database.url mysql://…)",
            );
        }
        let url = sync
            .binlog
            .url
            .clone()
            .unwrap_or_else(|| database.to_owned());
        if sync.binlog.url.is_some() && !mysql(&url) {
            p.add(
                format!("filters.{name}.sync.binlog.url"),
                "must be a mysql:// or mariadb:// URL",
            );
        }
        let table = p.check(
            format!("filters.{name}.source_query"),
            SourceTable::parse(&f.source_query),
        )?;
        Some(BinlogSource { table, url })
    }
}

/// The size of filter `name`, when its `expected_items` and `false_positive_rate` are
/// each valid and together fit.
fn filter_params(name: &str, f: &FilterConfig, p: &mut Problems) -> Option<BloomParams> {
    let at = |field: &str| format!("filters.{name}.{field}");
    let items_ok = f.expected_items > 0;
    if !items_ok {
        p.add(at("expected_items"), "must be at least 1");
    }
    // A gate that lets more than half of the absent keys through protects nothing, and
    // sizing a filter for a rate near 1 takes time that grows with the items.
    let rate = f.false_positive_rate;
    let rate_ok = rate > 0.0 && rate <= 0.5;
    if rate > 0.5 {
        p.add(at("false_positive_rate"), format!("{rate} is above 0.5"));
    } else if !rate_ok {
        p.add(
            at("false_positive_rate"),
            format!("must be greater than 0, got {rate}"),
        );
    }
    if !(items_ok && rate_ok) {
        return None;
    }
    p.check(
        at("false_positive_rate"),
        BloomParams::optimal(f.expected_items, rate),
    )
}

fn compile_write_through(
    i: usize,
    w: &WriteThroughConfig,
    filters: &BTreeMap<&str, usize>,
    p: &mut Problems,
) -> Option<CompiledWriteThrough> {
    let at = |field: &str| format!("write_through[{i}].{field}");
    let before = p.len();
    let pattern = p.check(at("path"), PathPattern::parse_write(&w.path, &w.key));
    let filter = filters.get(w.filter.as_str()).copied();
    if filter.is_none() {
        p.add(
            at("filter"),
            format!("no filter named `{}` in [filters]", w.filter),
        );
    }
    if w.methods.is_empty() {
        p.add(at("methods"), "must not be empty");
    }
    let methods = w
        .methods
        .iter()
        .filter_map(|m| {
            let method = Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                .map_err(|_| format!("`{m}` is not an HTTP method"));
            p.check(at("methods"), method)
        })
        .collect();
    let statuses = w
        .statuses
        .iter()
        .filter_map(|&s| p.check(at("statuses"), status(s)))
        .collect();
    if p.len() > before {
        return None;
    }
    Some(CompiledWriteThrough {
        pattern: pattern?,
        methods,
        statuses,
        key: w.key.clone(),
        filter: filter?,
    })
}

/// Why a configured value is not what its field needs; the message is the reason.
#[derive(Debug, thiserror::Error)]
enum BadValue {
    #[error("{0} is not an HTTP status")]
    Status(u16),
    #[error("not a URL")]
    Url(#[source] http::uri::InvalidUri),
    #[error("must start with http:// (terminate TLS in front of the upstream)")]
    NotHttp,
    #[error("needs a host and port")]
    NoHost,
    #[error("must not carry a path: requests keep their own path")]
    HasPath,
}

/// An HTTP status as a response carries it (100 to 599).
fn status(code: u16) -> Result<StatusCode, BadValue> {
    match StatusCode::from_u16(code) {
        Ok(s) if (100..=599).contains(&code) => Ok(s),
        _ => Err(BadValue::Status(code)),
    }
}

/// The `host:port` of an upstream URL of the form `http://host:port`.
fn upstream_authority(url: &str) -> Result<Authority, BadValue> {
    let uri: http::Uri = url.parse().map_err(BadValue::Url)?;
    if uri.scheme_str() != Some("http") {
        return Err(BadValue::NotHttp);
    }
    let has_path = uri.path() != "/" && !uri.path().is_empty();
    let Some(authority) = uri.into_parts().authority else {
        return Err(BadValue::NoHost);
    };
    if has_path {
        return Err(BadValue::HasPath);
    }
    Ok(authority)
}

#[cfg(test)]
mod tests;
