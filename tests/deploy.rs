//! How bloomgate is deployed, with the real binary: SIGINT drains an in-flight request
//! and exits 0; the compose deployment's own config and environment variables boot it
//! against a real MariaDB and Redis and take effect, and pass `check-config` for each
//! instance; docker-compose.yml runs one fleet (two instances, one namespace, distinct
//! ids, a Redis that never evicts) behind one load balancer, scraped instance by instance,
//! and publishes nothing but the load balancer's data plane beyond the host's loopback
//! interface; and a real nginx runs the load balancer's config, alternating between two
//! servers and passing over one that is down.
//!
//! There is no container engine here: the compose file is read, and its parts are run
//! one by one. The nginx test needs `nginx` (Debian's `nginx` package, which
//! `scripts/test` installs); like the MariaDB and Redis tests, it is skipped without it and
//! fails in CI.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bloomgate::db::{demo_absent_sku, demo_sku};
use bytes::Bytes;
use http::Method;
use support::binary::{BIN, Bloomgate, message};
use support::observe::filter_status;
use support::{
    ChildGuard, HttpClient, RedisOptions, StubUpstream, TestConfig, TestDb, TestRedis, TestRoute,
    eventually, mysql_url, redis_server, refused_absent_key,
};

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// docker-compose.yml as compose reads it: `<<` merge keys applied.
fn compose() -> serde_yaml::Value {
    let mut doc: serde_yaml::Value =
        serde_yaml::from_str(&read("docker-compose.yml")).expect("docker-compose.yml is YAML");
    doc.apply_merge().expect("merge keys");
    doc
}

/// What the tests put in .env: the compose file requires each of these.
const ENV_FILE: [(&str, &str); 2] = [
    ("MYSQL_PASSWORD", "compose-mysql-password"),
    ("REDIS_PASSWORD", "compose-redis-password"),
];

/// `text` with each `${VAR}`, `${VAR:-default}` and `${VAR:?message}` replaced as
/// compose replaces it, given the variables of [`ENV_FILE`] and no others.
fn interpolate(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let inner = &rest[at + 2..];
        let end = inner.find('}').expect("a closed ${...}");
        let reference = &inner[..end];
        let (name, default) = match reference.split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (reference.split(":?").next().unwrap_or_default(), None),
        };
        let value = ENV_FILE
            .iter()
            .find(|(var, _)| *var == name)
            .map(|(_, value)| *value)
            .or(default)
            .unwrap_or_else(|| panic!("compose would stop: {name} is unset"));
        out.push_str(value);
        rest = &inner[end + 1..];
    }
    out.push_str(rest);
    out
}

/// The text items of a YAML list (none if it is not one).
fn strings(v: &serde_yaml::Value) -> Vec<String> {
    v.as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

/// The variables docker-compose.yml gives each bloomgate instance.
const INSTANCE_VARS: [&str; 5] = [
    "BLOOMGATE__DATABASE__URL",
    "BLOOMGATE__ADMIN__TOKEN_FILE",
    "BLOOMGATE__FLEET__REDIS_URL",
    "BLOOMGATE__FLEET__NAMESPACE",
    "BLOOMGATE__FLEET__INSTANCE_ID",
];

/// The bloomgate instances of the compose file (the services built from this
/// repository), by service name.
fn instances(compose: &serde_yaml::Value) -> BTreeMap<String, serde_yaml::Value> {
    compose["services"]
        .as_mapping()
        .expect("services")
        .iter()
        .filter(|(_, service)| service["build"].as_str() == Some("."))
        .map(|(name, service)| (name.as_str().expect("name").to_owned(), service.clone()))
        .collect()
}

/// A service's `environment` mapping, its variables interpolated (see [`interpolate`]).
fn environment(service: &serde_yaml::Value) -> BTreeMap<String, String> {
    service["environment"]
        .as_mapping()
        .expect("an environment mapping")
        .iter()
        .map(|(k, v)| {
            let value = match v {
                serde_yaml::Value::String(s) => s.clone(),
                serde_yaml::Value::Number(n) => n.to_string(),
                other => panic!("environment value {other:?}"),
            };
            (
                k.as_str().expect("variable name").to_owned(),
                interpolate(&value),
            )
        })
        .collect()
}

/// One statement of an nginx config: the blocks around it (`["upstream bloomgate"]`) and
/// its words (`["server", "bloomgate-1:8080", …]`).
type Directive = (Vec<String>, Vec<String>);

/// The statements of an nginx config, comments dropped, quotes kept as one word.
fn nginx_directives(text: &str) -> Vec<Directive> {
    let mut out = Vec::new();
    let mut blocks: Vec<String> = Vec::new();
    let mut words: Vec<String> = Vec::new();
    let mut word = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '#' => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            }
            '"' => {
                word.push('"');
                for c in chars.by_ref() {
                    word.push(c);
                    if c == '"' {
                        break;
                    }
                }
            }
            ';' | '{' | '}' => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
                match c {
                    ';' => out.push((blocks.clone(), std::mem::take(&mut words))),
                    '{' => blocks.push(std::mem::take(&mut words).join(" ")),
                    _ => {
                        assert!(words.is_empty(), "unterminated statement {words:?}");
                        blocks.pop().expect("balanced braces");
                    }
                }
            }
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    assert!(
        blocks.is_empty() && words.is_empty(),
        "unbalanced nginx config"
    );
    out
}

/// The arguments of each `name` statement directly inside the blocks `within`.
fn nginx_args(directives: &[Directive], within: &[&str], name: &str) -> Vec<Vec<String>> {
    directives
        .iter()
        .filter(|(blocks, words)| blocks == within && words.first().is_some_and(|w| w == name))
        .map(|(_, words)| words[1..].to_vec())
        .collect()
}

/// The load balancer's config.
const NGINX_CONF: &str = "deploy/nginx/bloomgate.conf";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_finishes_the_in_flight_request_then_exits_0() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    // The upstream lacks every product, and holds its "not found" until told.
    let stub = StubUpstream::start([]).await;
    let config = TestConfig::new(&db.url)
        .server("listen = \"127.0.0.1:0\"")
        .server("shutdown_grace = \"10s\"")
        // Two serving threads, each with a listener of its own: both must have stopped
        // accepting before a new connection is sure to be refused.
        .server("workers = 2")
        .admin("listen = \"127.0.0.1:0\"")
        .upstream(&stub.url())
        .expected_items(100)
        .route(TestRoute::upstream("products", "/api/products/{id}"))
        .toml();
    let mut bin = Bloomgate::serve(&config, &[]).await;
    bin.wait_for_log("the filter load", Duration::from_secs(60), |l| {
        message(l) == "filter loaded"
    })
    .await;

    let (reached, release) = stub.hold_next_not_found();
    let key = demo_sku(5);
    let url = format!("http://{}/api/products/{key}", bin.data);
    let in_flight = tokio::spawn(async move {
        HttpClient::new()
            .send(Method::GET, &url, &[], Bytes::new())
            .await
    });
    let seen = tokio::time::timeout(Duration::from_secs(30), reached)
        .await
        .expect("the request reached the upstream")
        .expect("stub alive");
    assert_eq!(seen, key);

    bin.signal("INT");
    let draining = bin
        .wait_for_logs(
            "every data listener draining",
            2,
            Duration::from_secs(10),
            |l| message(l) == "stopped accepting; draining" && l["fields"]["listener"] == "data",
        )
        .await;
    let threads: BTreeSet<&str> = draining
        .iter()
        .filter_map(|l| l["fields"]["thread"].as_str())
        .collect();
    assert_eq!(threads, BTreeSet::from(["0", "1"]), "{draining:#?}");
    assert!(
        tokio::net::TcpStream::connect(bin.data).await.is_err(),
        "new connections are refused once draining"
    );
    assert!(
        !in_flight.is_finished(),
        "the request is still held upstream"
    );

    let _ = release.send(());
    let reply = tokio::time::timeout(Duration::from_secs(10), in_flight)
        .await
        .expect("the in-flight request finished")
        .expect("join");
    assert_eq!(
        (reply.status.as_u16(), reply.stage()),
        (404, "miss"),
        "{}",
        reply.text()
    );
    assert_eq!(bin.wait_exit(Duration::from_secs(10)).await, Some(0));
    bin.wait_for_log("the last line", Duration::from_secs(5), |l| {
        message(l) == "stopped"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_config_and_environment_boot_against_the_database_they_name() {
    let Some(server) = mysql_url() else { return };
    let Some(redis_bin) = redis_server() else {
        return;
    };
    const N: u64 = 1_000;
    let db = TestDb::create(&server, N).await;
    // The compose file's Redis users (its default user off, bloomgate's limited to the
    // namespace and the commands it uses), beside the harness's own.
    let compose = compose();
    let redis_command: Vec<String> = compose["services"]["redis"]["command"]
        .as_sequence()
        .expect("the redis command")
        .iter()
        .map(|w| interpolate(w.as_str().expect("a word")))
        .collect();
    // bloomgate's user; the harness switches the default user off itself (redis-server
    // refuses a user declared twice).
    let user = redis_command
        .windows(2)
        .position(|w| w == ["--user", "bloomgate"])
        .expect("bloomgate's ACL user");
    let end = redis_command[user + 1..]
        .iter()
        .position(|w| w.starts_with("--"))
        .map_or(redis_command.len(), |n| user + 1 + n);
    let user_args: Vec<&str> = redis_command[user..end]
        .iter()
        .map(String::as_str)
        .collect();
    let redis = TestRedis::start_with(
        &redis_bin,
        RedisOptions::new()
            .acl_user("harness", "harness-password")
            .args(&user_args),
    )
    .await;

    // The variables docker-compose.yml gives the first instance, by the names it uses.
    let (_, first) = instances(&compose)
        .into_iter()
        .next()
        .expect("a bloomgate instance");
    let env = environment(&first);
    let names: BTreeSet<&str> = env
        .keys()
        .map(String::as_str)
        .filter(|k| k.starts_with("BLOOMGATE__"))
        .collect();
    assert_eq!(names, BTreeSet::from(INSTANCE_VARS));
    let config = read("config.compose.toml");
    assert!(config.contains("@mysql:3306/shop"));
    assert!(
        !config.contains("\ntoken"),
        "no token in the mounted config"
    );
    // The secret file compose makes from BLOOMGATE_ADMIN_TOKEN, with its line break.
    let secrets = tempfile::tempdir().expect("secrets directory");
    let token_file = secrets.path().join("admin_token");
    let file_token = "token-from-the-secret-file";
    std::fs::write(&token_file, format!("{file_token}\n")).expect("write the secret");
    let token_path = token_file.to_str().expect("a UTF-8 path");
    // The compose URL, with the test's Redis in place of the `redis` service.
    let redis_url = env["BLOOMGATE__FLEET__REDIS_URL"]
        .replace("@redis:6379", &format!("@127.0.0.1:{}", redis.port()));

    let mut bin = Bloomgate::serve(
        &config,
        &[
            ("BLOOMGATE__DATABASE__URL", db.url.as_str()),
            ("BLOOMGATE__ADMIN__TOKEN_FILE", token_path),
            ("BLOOMGATE__FLEET__REDIS_URL", redis_url.as_str()),
            (
                "BLOOMGATE__FLEET__NAMESPACE",
                env["BLOOMGATE__FLEET__NAMESPACE"].as_str(),
            ),
            (
                "BLOOMGATE__FLEET__INSTANCE_ID",
                env["BLOOMGATE__FLEET__INSTANCE_ID"].as_str(),
            ),
            // The compose file's addresses are the container's; here, loopback port 0.
            ("BLOOMGATE__SERVER__LISTEN", "127.0.0.1:0"),
            ("BLOOMGATE__ADMIN__LISTEN", "127.0.0.1:0"),
        ],
    )
    .await;
    // The database from the environment: the filter holds its rows, and lookups find them.
    let loaded = bin
        .wait_for_log("the filter load", Duration::from_secs(60), |l| {
            message(l) == "filter loaded"
        })
        .await;
    assert_eq!(loaded["fields"]["rows"], N, "{loaded}");
    let client = HttpClient::new();
    // The line is logged just before the build's status is recorded.
    eventually("the load's status", Duration::from_secs(10), || async {
        filter_status(&client, bin.admin, "products").await["last_load"]["rows"] == N
    })
    .await;
    let get = |path: String| {
        let client = client.clone();
        let data = bin.data;
        async move {
            client
                .send(
                    Method::GET,
                    &format!("http://{data}{path}"),
                    &[],
                    Bytes::new(),
                )
                .await
        }
    };
    let r = get(format!("/api/products/{}", demo_sku(3))).await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (200, "miss"),
        "{}",
        r.text()
    );
    assert_eq!(r.json()["sku_id"], demo_sku(3));
    let r = get(format!("/api/product/info?sku_id={}", demo_absent_sku(3))).await;
    assert_eq!((r.status.as_u16(), r.stage()), (404, "intercepted"));

    // The token is the secret file's.
    let rebuild = |token: &'static str| {
        let client = client.clone();
        let admin = bin.admin;
        async move {
            let auth = format!("Bearer {token}");
            client
                .send(
                    Method::POST,
                    &format!("http://{admin}/admin/filters/products/rebuild"),
                    &[("authorization", auth.as_str())],
                    Bytes::new(),
                )
                .await
        }
    };
    let r = rebuild("not-the-admin-token").await;
    assert_eq!(r.status.as_u16(), 401, "{}", r.text());
    let r = rebuild(file_token).await;
    assert_eq!(r.status.as_u16(), 202, "{}", r.text());
    bin.wait_for_logs("the requested rebuild", 2, Duration::from_secs(60), |l| {
        message(l) == "filter loaded"
    })
    .await;
}

/// A published port: host address (`None`: every interface), host port, container port.
fn published(entry: &serde_yaml::Value) -> (Option<String>, String, String) {
    if let Some(map) = entry.as_mapping() {
        let field = |k: &str| {
            map.get(k).map(|v| match v {
                serde_yaml::Value::Number(n) => n.to_string(),
                other => other.as_str().unwrap_or_default().to_owned(),
            })
        };
        return (
            field("host_ip"),
            field("published").unwrap_or_default(),
            field("target").unwrap_or_default(),
        );
    }
    let text = match entry {
        serde_yaml::Value::Number(n) => n.to_string(),
        other => other.as_str().expect("a port entry").to_owned(),
    };
    let text = text.split('/').next().unwrap_or_default();
    // IPv6 host addresses are bracketed: "[::1]:9090:9090".
    let (ip, rest) = match text.strip_prefix('[') {
        Some(v6) => {
            let (ip, rest) = v6.split_once("]:").expect("[ip]:host:container");
            (Some(ip.to_owned()), rest.to_owned())
        }
        None => (None, text.to_owned()),
    };
    let parts: Vec<&str> = rest.split(':').collect();
    match (ip, parts.as_slice()) {
        (Some(ip), [host, container]) => (Some(ip), (*host).into(), (*container).into()),
        (None, [ip, host, container]) => (Some((*ip).into()), (*host).into(), (*container).into()),
        (None, [host, container]) => (None, (*host).into(), (*container).into()),
        (None, [container]) => (None, String::new(), (*container).into()),
        _ => panic!("unreadable port entry {entry:?}"),
    }
}

/// The port nginx listens on in the load balancer's config.
fn lb_listen_port() -> String {
    let directives = nginx_directives(&read(NGINX_CONF));
    let listen = nginx_args(&directives, &["server"], "listen");
    assert_eq!(listen.len(), 1, "one listen statement: {listen:?}");
    listen[0][0]
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn compose_publishes_only_the_data_plane_beyond_loopback() {
    let config = bloomgate::config::Config::from_toml_str(&read("config.compose.toml"))
        .expect("config.compose.toml is valid");
    let data_port = config.server.listen.port().to_string();
    let admin_port = config.admin.listen.port().to_string();
    let lb_port = lb_listen_port();
    let compose = compose();
    let instances = instances(&compose);
    let services = compose["services"].as_mapping().expect("services");
    let mut data_published = 0;
    let mut admin_published = BTreeMap::new();
    for (name, service) in services {
        let name = name.as_str().unwrap_or_default();
        let instance = instances.contains_key(name);
        for entry in service["ports"].as_sequence().into_iter().flatten() {
            let (ip, host, container) = published(entry);
            if name == "lb" && container == lb_port {
                data_published += 1;
                continue;
            }
            assert!(
                !(instance && container == data_port),
                "{name} publishes its data plane: the load balancer is the one address"
            );
            if instance && container == admin_port {
                admin_published
                    .entry(name.to_owned())
                    .or_insert_with(Vec::new)
                    .push(host.clone());
            }
            assert!(
                matches!(ip.as_deref(), Some("127.0.0.1") | Some("::1")),
                "{name} publishes {host}:{container} on every interface: {entry:?}"
            );
        }
    }
    assert_eq!(
        data_published, 1,
        "the load balancer publishes the data plane"
    );
    let admin_hosts: BTreeSet<&String> = admin_published.values().flatten().collect();
    assert_eq!(
        admin_published.keys().collect::<Vec<_>>(),
        instances.keys().collect::<Vec<_>>(),
        "each instance publishes its admin plane"
    );
    assert!(
        admin_published.values().all(|hosts| hosts.len() == 1)
            && admin_hosts.len() == instances.len(),
        "once each, on distinct host ports: {admin_published:?}"
    );
}

#[test]
fn compose_runs_one_fleet_behind_one_address() {
    let config = bloomgate::config::Config::from_toml_str(&read("config.compose.toml"))
        .expect("config.compose.toml is valid");
    let data_port = config.server.listen.port();
    let admin_port = config.admin.listen.port();
    let compose = compose();
    let services = &compose["services"];
    let instances = instances(&compose);
    assert_eq!(
        instances.keys().map(String::as_str).collect::<Vec<_>>(),
        ["bloomgate-1", "bloomgate-2"]
    );

    // One fleet: the same Redis and namespace, distinct instance ids, and otherwise the
    // same service.
    let envs: BTreeMap<&str, BTreeMap<String, String>> = instances
        .iter()
        .map(|(name, service)| (name.as_str(), environment(service)))
        .collect();
    for (name, env) in &envs {
        assert_eq!(
            env.keys().map(String::as_str).collect::<BTreeSet<_>>(),
            BTreeSet::from(INSTANCE_VARS),
            "{name}"
        );
        let password = ENV_FILE[1].1;
        assert_eq!(
            env["BLOOMGATE__FLEET__REDIS_URL"],
            format!("redis://bloomgate:{password}@redis:6379")
        );
    }
    let namespaces: BTreeSet<&str> = envs
        .values()
        .map(|e| e["BLOOMGATE__FLEET__NAMESPACE"].as_str())
        .collect();
    assert_eq!(namespaces.len(), 1, "one namespace: {namespaces:?}");
    let ids: BTreeSet<&str> = envs
        .values()
        .map(|e| e["BLOOMGATE__FLEET__INSTANCE_ID"].as_str())
        .collect();
    assert_eq!(ids.len(), instances.len(), "distinct instance ids: {ids:?}");
    let alike = |service: &serde_yaml::Value| {
        let mut env = environment(service);
        env.remove("BLOOMGATE__FLEET__INSTANCE_ID");
        let mut service = service.clone();
        let map = service.as_mapping_mut().expect("a service mapping");
        map.remove("ports");
        map.remove("environment");
        (service, env)
    };
    let mut shapes = instances.values().map(alike);
    let first = shapes.next().expect("an instance");
    for other in shapes {
        assert_eq!(
            other, first,
            "the instances differ in id and admin port only"
        );
    }
    for instance in instances.values() {
        for dependency in ["mysql", "redis"] {
            assert_eq!(
                instance["depends_on"][dependency]["condition"].as_str(),
                Some("service_healthy"),
                "an instance starts once {dependency} is healthy"
            );
        }
    }

    // Redis: never evicts, keeps its data in a volume, is health-checked, not published.
    let redis = &services["redis"];
    assert!(
        redis["image"]
            .as_str()
            .is_some_and(|i| i.starts_with("redis:7")),
        "Redis 7"
    );
    let command: Vec<&str> = redis["command"]
        .as_sequence()
        .expect("redis command as a list")
        .iter()
        .map(|a| a.as_str().expect("text argument"))
        .collect();
    let option = |name: &str| {
        let at = command
            .iter()
            .position(|a| *a == name)
            .unwrap_or_else(|| panic!("redis runs without {name}: {command:?}"));
        command.get(at + 1).copied()
    };
    assert_eq!(option("--maxmemory-policy"), Some("noeviction"));
    assert_eq!(option("--appendonly"), Some("yes"));
    assert!(
        option("--maxmemory").is_some_and(|m| m != "0"),
        "a memory limit"
    );
    let volumes = strings(&redis["volumes"]);
    let data_volume = volumes
        .iter()
        .find_map(|v| v.strip_suffix(":/data"))
        .expect("a volume on /data");
    assert!(
        compose["volumes"]
            .as_mapping()
            .is_some_and(|v| v.contains_key(data_volume)),
        "{data_volume} is a named volume"
    );
    let health = strings(&redis["healthcheck"]["test"]).join(" ");
    assert!(
        health.contains("redis-cli --user bloomgate ping"),
        "{health}"
    );
    assert!(redis["ports"].is_null(), "Redis is not published");

    // The load balancer: nginx, round robin over exactly the instances' data planes.
    let lb = &services["lb"];
    assert!(
        lb["image"]
            .as_str()
            .is_some_and(|i| i.starts_with("nginx:"))
    );
    assert!(
        strings(&lb["volumes"])
            .contains(&format!("./{NGINX_CONF}:/etc/nginx/conf.d/default.conf:ro")),
        "the config is mounted"
    );
    let lb_port = lb_listen_port();
    assert_eq!(strings(&lb["ports"]), [format!("{lb_port}:{lb_port}")]);
    let depends: BTreeSet<String> = lb["depends_on"]
        .as_mapping()
        .expect("depends_on by service")
        .iter()
        .filter(|(_, how)| how["condition"].as_str() == Some("service_healthy"))
        .filter_map(|(name, _)| name.as_str().map(str::to_owned))
        .collect();
    assert_eq!(depends, instances.keys().cloned().collect());
    let directives = nginx_directives(&read(NGINX_CONF));
    let upstream = ["upstream bloomgate"];
    let servers: BTreeSet<String> = nginx_args(&directives, &upstream, "server")
        .into_iter()
        .map(|args| args[0].clone())
        .collect();
    let expected: BTreeSet<String> = instances
        .keys()
        .map(|name| format!("{name}:{data_port}"))
        .collect();
    assert_eq!(servers, expected, "the upstreams are the instances");
    assert!(
        nginx_args(&directives, &upstream, "hash").is_empty()
            && nginx_args(&directives, &upstream, "ip_hash").is_empty()
            && nginx_args(&directives, &upstream, "least_conn").is_empty(),
        "round robin"
    );
    assert_eq!(
        nginx_args(&directives, &["server", "location /"], "proxy_pass"),
        [["http://bloomgate"]]
    );
    // nginx lets an idle connection go before bloomgate closes it.
    let idle = nginx_args(&directives, &upstream, "keepalive_timeout");
    let idle = humantime::parse_duration(&idle[0][0]).expect("keepalive_timeout");
    assert!(
        idle < config.server.header_read_timeout,
        "{idle:?} against {:?}",
        config.server.header_read_timeout
    );

    // Prometheus scrapes every instance's admin plane.
    let prometheus: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/prometheus/prometheus.yml")).expect("YAML");
    let targets: BTreeSet<String> = prometheus["scrape_configs"]
        .as_sequence()
        .expect("scrape_configs")
        .iter()
        .flat_map(|job| {
            job["static_configs"]
                .as_sequence()
                .cloned()
                .unwrap_or_default()
        })
        .flat_map(|c| strings(&c["targets"]))
        .collect();
    let expected: BTreeSet<String> = instances
        .keys()
        .map(|name| format!("{name}:{admin_port}"))
        .collect();
    assert_eq!(targets, expected);
    let depends: BTreeSet<String> = strings(&services["prometheus"]["depends_on"])
        .into_iter()
        .collect();
    assert_eq!(depends, instances.keys().cloned().collect());
}

#[test]
fn the_compose_environment_of_each_instance_passes_check_config() {
    let compose = compose();
    let secrets = tempfile::tempdir().expect("secrets directory");
    let token_file = secrets.path().join("admin_token");
    std::fs::write(&token_file, "a-token-from-the-secret\n").expect("write the secret");
    for (name, service) in instances(&compose) {
        let mut env = environment(&service);
        // compose mounts the secret at the path the variable names; here, a temp file.
        assert_eq!(
            env.insert(
                "BLOOMGATE__ADMIN__TOKEN_FILE".into(),
                token_file.display().to_string()
            )
            .as_deref(),
            Some("/run/secrets/admin_token")
        );
        let check = |env: &BTreeMap<String, String>| {
            let mut cmd = Command::new(BIN);
            cmd.args(["check-config", "--config"])
                .arg(repo("config.compose.toml"))
                .stdin(Stdio::null());
            for (var, _) in std::env::vars_os() {
                if var.to_string_lossy().starts_with("BLOOMGATE__") {
                    cmd.env_remove(var);
                }
            }
            let out = cmd.envs(env).output().expect("run bloomgate check-config");
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr),
            )
        };
        let (code, text) = check(&env);
        assert_eq!(code, Some(0), "{name}: {text}");
        // The fleet variables reach the [fleet] section: a bad one is refused by name.
        let mut bad = env.clone();
        bad.insert(
            "BLOOMGATE__FLEET__INSTANCE_ID".into(),
            format!("{name} with spaces"),
        );
        let (code, text) = check(&bad);
        assert_eq!(code, Some(2), "{name}: {text}");
        assert!(text.contains("fleet.instance_id"), "{name}: {text}");
        // Without the secret, the instance refuses to start, naming the field.
        let mut unset = env.clone();
        unset.insert(
            "BLOOMGATE__ADMIN__TOKEN_FILE".into(),
            secrets.path().join("missing").display().to_string(),
        );
        let (code, text) = check(&unset);
        assert_eq!(code, Some(2), "{name}: {text}");
        assert!(text.contains("admin.token_file"), "{name}: {text}");
    }
}

#[test]
fn port_entries_are_read_in_every_compose_form() {
    let parse = |yaml: &str| published(&serde_yaml::from_str(yaml).expect("yaml"));
    let s = |v: &str| v.to_owned();
    assert_eq!(parse("\"9090:9090\""), (None, s("9090"), s("9090")));
    assert_eq!(
        parse("\"127.0.0.1:9091:9090\""),
        (Some(s("127.0.0.1")), s("9091"), s("9090"))
    );
    assert_eq!(
        parse("\"[::1]:9090:9090/tcp\""),
        (Some(s("::1")), s("9090"), s("9090"))
    );
    assert_eq!(parse("9090"), (None, s(""), s("9090")));
    assert_eq!(
        parse("{ target: 9090, published: 9090, host_ip: 127.0.0.1 }"),
        (Some(s("127.0.0.1")), s("9090"), s("9090"))
    );
    assert_eq!(
        parse("{ target: 9090, published: \"9090\" }"),
        (None, s("9090"), s("9090"))
    );
}

/// The `nginx` binary, on `PATH` or in /usr/sbin. The skip rule is the MariaDB tests'
/// ([`mysql_url`]): without it, the test fails if `CI` is set to anything but the empty
/// string, and otherwise passes without running, saying so once on stderr.
fn nginx_binary() -> Option<PathBuf> {
    let dirs = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    let found = dirs
        .into_iter()
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("nginx"))
        .find(|p| p.is_file());
    if found.is_none() {
        let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
        assert!(
            !ci,
            "nginx not found but CI is set: run the tests through scripts/test"
        );
        use std::io::Write as _;
        // Straight to the process's stderr: libtest captures eprintln!.
        let _ = writeln!(
            std::io::stderr(),
            "skipping the nginx test: nginx not found (scripts/test installs it; with CI \
             set it fails instead)"
        );
    }
    found
}

/// Replaces the one occurrence of `from` in `text`.
fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert_eq!(
        text.matches(from).count(),
        1,
        "one {from:?} in {NGINX_CONF}"
    );
    text.replacen(from, to, 1)
}

/// A real nginx running the load balancer's config, the instances' names replaced by
/// test servers and its listen port by a free loopback one; killed when dropped.
struct TestNginx {
    addr: SocketAddr,
    _child: ChildGuard,
    _dir: tempfile::TempDir,
}

impl TestNginx {
    /// Checks the config with `nginx -t`, then runs it; returns once it accepts
    /// connections. `upstreams` stand for the instances, in service-name order.
    async fn start(bin: &Path, upstreams: &[SocketAddr]) -> TestNginx {
        let compose = compose();
        let instances = instances(&compose);
        assert_eq!(instances.len(), upstreams.len());
        let data_port = bloomgate::config::Config::from_toml_str(&read("config.compose.toml"))
            .expect("config.compose.toml is valid")
            .server
            .listen
            .port();
        let lb_port = lb_listen_port();
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("nginx directory");
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let mut site = replace_once(
                &read(NGINX_CONF),
                &format!("listen {lb_port};"),
                &format!("listen 127.0.0.1:{port};"),
            );
            for (name, addr) in instances.keys().zip(upstreams) {
                // `resolve` re-resolves a name; the test's servers are addresses, and
                // nginx before 1.27.3 (Debian 12 has 1.22) lacks the parameter.
                site = replace_once(
                    &site,
                    &format!("server {name}:{data_port} resolve "),
                    &format!("server {addr} "),
                );
            }
            let d = dir.path().display();
            std::fs::write(dir.path().join("bloomgate.conf"), site).expect("write site");
            let main = format!(
                "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\n\
                 events {{ worker_connections 64; }}\n\
                 http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  \
                 proxy_temp_path {d}/proxy;\n  include {d}/bloomgate.conf;\n}}\n"
            );
            let conf = dir.path().join("nginx.conf");
            std::fs::write(&conf, main).expect("write nginx.conf");
            let log = dir.path().join("error.log");
            let args = |cmd: &mut Command| {
                cmd.arg("-p")
                    .arg(dir.path())
                    .arg("-e")
                    .arg(&log)
                    .arg("-c")
                    .arg(&conf)
                    .stdin(Stdio::null());
            };
            let mut test = Command::new(bin);
            args(&mut test);
            let out = test.arg("-t").output().expect("run nginx -t");
            assert!(
                out.status.success(),
                "nginx -t:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );

            let mut cmd = Command::new(bin);
            args(&mut cmd);
            let mut child = ChildGuard::spawn(cmd.stdout(Stdio::null()).stderr(Stdio::null()));
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if let Ok(Some(status)) = child.try_wait() {
                    let text = std::fs::read_to_string(&log).unwrap_or_default();
                    if text.contains("Address already in use") {
                        break;
                    }
                    panic!("nginx exited ({status}):\n{text}");
                }
                if tokio::net::TcpStream::connect(addr).await.is_ok() {
                    return TestNginx {
                        addr,
                        _child: child,
                        _dir: dir,
                    };
                }
                assert!(Instant::now() < deadline, "nginx not listening within 30 s");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        panic!("nginx found every port it was given taken");
    }
}

#[tokio::test]
async fn the_load_balancer_alternates_between_the_instances_and_passes_over_a_dead_one() {
    let Some(bin) = nginx_binary() else { return };
    let key = demo_sku(1);
    // Real HTTP servers standing in for the two instances, counting what reaches them.
    let one = StubUpstream::start([key]).await;
    let two = StubUpstream::start([key]).await;
    let lb = TestNginx::start(&bin, &[one.addr, two.addr]).await;
    let client = HttpClient::new();
    let url = format!("http://{}/api/products/{key}", lb.addr);
    let get = || client.send(Method::GET, &url, &[], Bytes::new());

    for _ in 0..20 {
        let r = get().await;
        assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    }
    assert_eq!((one.hits(), two.hits()), (10, 10), "round robin");
    let seen = one.last_request_headers();
    assert_eq!(
        seen.get("x-forwarded-for").map(|v| v.as_bytes()),
        Some(&b"127.0.0.1"[..]),
        "the client's address is passed on"
    );

    // The second instance goes away: every request is still answered, by the first.
    let two_state = std::sync::Arc::clone(&two.state);
    let two_addr = two.addr;
    drop(two);
    eventually(
        "the second server refuses",
        Duration::from_secs(10),
        || async { tokio::net::TcpStream::connect(two_addr).await.is_err() },
    )
    .await;
    for _ in 0..10 {
        let r = get().await;
        assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    }
    assert_eq!(one.hits(), 20);
    assert_eq!(
        two_state
            .product_hits
            .load(std::sync::atomic::Ordering::SeqCst),
        10
    );
}

/// docker-compose.cluster.yml as compose reads it: `<<` merge keys applied.
fn cluster_compose() -> serde_yaml::Value {
    let mut doc: serde_yaml::Value = serde_yaml::from_str(&read("docker-compose.cluster.yml"))
        .expect("docker-compose.cluster.yml is YAML");
    doc.apply_merge().expect("merge keys");
    doc
}

/// The words of a node's `sh -c` command line as the shell splits them: `$$` is
/// compose's escape of `$`, `$REDIS_PASSWORD` the variable the node is given, and
/// `"..."` and `\|` quote.
fn node_words(service: &serde_yaml::Value) -> Vec<String> {
    let entry = strings(&service["entrypoint"]);
    assert_eq!(&entry[..2], ["sh", "-c"], "{entry:?}");
    let line = entry[2]
        .replace("$$REDIS_PASSWORD", ENV_FILE[1].1)
        .replace("$$(hostname)", "node");
    line.split_whitespace()
        .map(|w| w.trim_matches('"').replace("\\|", "|"))
        .collect()
}

/// What follows `--user bloomgate` up to the next option: the user's ACL rule.
fn user_rule(words: &[String]) -> Vec<String> {
    let at = words
        .windows(2)
        .position(|w| w == ["--user", "bloomgate"])
        .expect("bloomgate's ACL user");
    words[at + 2..]
        .iter()
        .take_while(|w| !w.starts_with("--"))
        .cloned()
        .collect()
}

/// The cluster file changes only the instances' Redis: six cluster nodes that never
/// evict, joined once by a one-shot service the instances wait for, bloomgate's user on
/// them as in the main file plus the one command a cluster client needs, and one URL
/// naming every node. Then the same user on a real six-node cluster lets the real
/// fleet run: a generation published and its copy in Redis asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_compose_file_runs_the_fleet_on_a_cluster_with_the_same_user() {
    let main = compose();
    let cluster = cluster_compose();
    let services = cluster["services"].as_mapping().expect("services");
    let nodes: Vec<&str> = services
        .keys()
        .filter_map(|k| k.as_str())
        .filter(|k| k.starts_with("redis-node-"))
        .collect();
    assert_eq!(
        nodes.len(),
        6,
        "three primaries and three replicas: {nodes:?}"
    );
    let main_words: Vec<String> = strings(&main["services"]["redis"]["command"])
        .iter()
        .map(|w| interpolate(w))
        .collect();
    let mut main_rule = user_rule(&main_words);
    main_rule.push("+cluster|slots".to_owned());
    main_rule.sort();
    let init = &cluster["services"]["redis-cluster-init"];
    for node in &nodes {
        let service = &cluster["services"][*node];
        assert_eq!(service["hostname"].as_str(), Some(*node));
        let words = node_words(service);
        for (option, value) in [
            ("--cluster-enabled", "yes"),
            ("--maxmemory-policy", "noeviction"),
            ("--appendonly", "yes"),
            ("--cluster-preferred-endpoint-type", "hostname"),
        ] {
            let at = words.iter().position(|w| w == option);
            assert_eq!(
                at.and_then(|i| words.get(i + 1)).map(String::as_str),
                Some(value),
                "{node}: {option}"
            );
        }
        let mut rule = user_rule(&words);
        rule.sort();
        assert_eq!(
            rule, main_rule,
            "{node}: bloomgate's user differs from the main file's"
        );
        assert_eq!(
            init["depends_on"][*node]["condition"].as_str(),
            Some("service_healthy")
        );
        assert!(service["ports"].is_null(), "{node} is not published");
    }
    let mut urls = BTreeSet::new();
    for name in ["bloomgate-1", "bloomgate-2"] {
        let instance = &cluster["services"][name];
        assert_eq!(
            instance["depends_on"]["redis-cluster-init"]["condition"].as_str(),
            Some("service_completed_successfully")
        );
        let env = environment(instance);
        assert_eq!(
            env.len(),
            1,
            "the cluster file changes only the Redis URL: {env:?}"
        );
        urls.insert(env["BLOOMGATE__FLEET__REDIS_URL"].clone());
    }
    assert_eq!(urls.len(), 1, "both instances name one cluster");
    let url = urls.pop_first().expect("a URL");
    let Ok(bloomgate::config::RedisTarget::Cluster(seeds)) =
        bloomgate::config::RedisTarget::parse(&url)
    else {
        panic!("{url} is not a cluster URL");
    };
    let named: Vec<String> = nodes.iter().map(|n| format!("{n}:6379")).collect();
    for n in &named {
        assert!(
            seeds.iter().any(|s| s.ends_with(&format!("@{n}"))),
            "{n} missing from {url}"
        );
    }
    assert_eq!(seeds.len(), nodes.len());

    // The user on a real cluster, the instance's URL pointed at it.
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let user: Vec<String> = ["--user", "bloomgate"]
        .into_iter()
        .map(str::to_owned)
        .chain(user_rule(&node_words(&cluster["services"][nodes[0]])))
        .collect();
    let user: Vec<&str> = user.iter().map(String::as_str).collect();
    let real =
        support::topology::TestCluster::start_with(&redis_bin, Some("admin-pw"), &user).await;
    let mut local = url.clone();
    for (i, n) in named.iter().enumerate() {
        local = local.replace(n, &format!("127.0.0.1:{}", real.port(i)));
    }
    let db = TestDb::create(&server, 1_000).await;
    let config = TestConfig::new(&db.url)
        .expected_items(2_000)
        .filter("backend = \"redis\"")
        .filter("redis = { shard_bytes = 4096 }")
        .route(TestRoute::sql("products", "/api/products/{id}"))
        .fleet(format!("redis_url = \"{local}\""))
        .fleet("namespace = \"shop\"")
        .toml();
    let proxy = support::TestProxy::spawn(&config).await;
    proxy.wait_ready(Duration::from_secs(60)).await;
    eventually(
        "a builder on the cluster",
        Duration::from_secs(60),
        || async {
            let f = proxy.admin_get("/admin/fleet").await.json();
            f["redis"]["up"] == true && f["filters"][0]["serving"]["generation"].as_u64() >= Some(1)
        },
    )
    .await;
    let counter = "bloomgate_filter_redis_checks_total{answer=\"absent\",filter=\"products\"}";
    let absent = refused_absent_key(&proxy, "/api/products/", 7).await;
    eventually(
        "a refusal answered by the copy in Redis",
        Duration::from_secs(60),
        || async {
            let r = proxy.get(&format!("/api/products/{absent}")).await;
            r.status.as_u16() == 404 && proxy.counter_or_zero(counter).await > 0.0
        },
    )
    .await;
    let r = proxy.get(&format!("/api/products/{}", demo_sku(7))).await;
    assert_eq!(r.status.as_u16(), 200);
    let writes = proxy
        .metric_or_absent(
            "bloomgate_filter_redis_writes_total{filter=\"products\",kind=\"generation\",result=\"error\"}",
        )
        .await;
    assert_eq!(writes, None, "a write was refused on the cluster");
}
