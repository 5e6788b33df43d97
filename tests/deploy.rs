//! How bloomgate is deployed, with the real binary: SIGINT drains an in-flight request
//! and exits 0; the compose deployment's own config and environment variables boot it
//! against a real MariaDB and take effect; and docker-compose.yml publishes nothing but
//! the data plane beyond the host's loopback interface.

mod support;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use bloomgate::db::{demo_absent_sku, demo_sku};
use bytes::Bytes;
use http::Method;
use support::binary::{Bloomgate, message};
use support::observe::filter_status;
use support::{HttpClient, StubUpstream, TestConfig, TestDb, TestRoute, eventually, mysql_url};

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

fn compose() -> serde_yaml::Value {
    serde_yaml::from_str(&read("docker-compose.yml")).expect("docker-compose.yml is YAML")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_finishes_the_in_flight_request_then_exits_0() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    // The upstream lacks every product, and holds its "not found" until told.
    let stub = StubUpstream::start([]).await;
    let config = TestConfig::new(&db.url)
        .server("listen = \"127.0.0.1:0\"")
        .server("shutdown_grace = \"10s\"")
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
    bin.wait_for_log("the data plane draining", Duration::from_secs(10), |l| {
        message(l) == "stopped accepting; draining" && l["fields"]["listener"] == "data"
    })
    .await;
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
    const N: u64 = 1_000;
    let db = TestDb::create(&server, N).await;

    // The variables docker-compose.yml gives bloomgate, by the names it uses.
    let compose = compose();
    let env = compose["services"]["bloomgate"]["environment"]
        .as_mapping()
        .expect("bloomgate's environment is a mapping");
    let names: BTreeSet<&str> = env
        .keys()
        .filter_map(|k| k.as_str())
        .filter(|k| k.starts_with("BLOOMGATE__"))
        .collect();
    assert_eq!(
        names,
        BTreeSet::from(["BLOOMGATE__DATABASE__URL", "BLOOMGATE__ADMIN__TOKEN"])
    );
    let file_token = "compose-admin-token";
    let env_token = "token-from-the-environment";
    let config = read("config.compose.toml");
    assert!(config.contains(&format!("token = \"{file_token}\"")));
    assert!(config.contains("@mysql:3306/shop"));

    let mut bin = Bloomgate::serve(
        &config,
        &[
            ("BLOOMGATE__DATABASE__URL", db.url.as_str()),
            ("BLOOMGATE__ADMIN__TOKEN", env_token),
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

    // The token from the environment replaces the file's.
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
    let r = rebuild(file_token).await;
    assert_eq!(r.status.as_u16(), 401, "{}", r.text());
    let r = rebuild(env_token).await;
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

#[test]
fn compose_publishes_only_the_data_plane_beyond_loopback() {
    let config = bloomgate::config::Config::from_toml_str(&read("config.compose.toml"))
        .expect("config.compose.toml is valid");
    let data_port = config.server.listen.port().to_string();
    let admin_port = config.admin.listen.port().to_string();
    let compose = compose();
    let services = compose["services"].as_mapping().expect("services");
    let mut admin_published = 0;
    for (name, service) in services {
        let name = name.as_str().unwrap_or_default();
        for entry in service["ports"].as_sequence().into_iter().flatten() {
            let (ip, host, container) = published(entry);
            if name == "bloomgate" && container == data_port {
                continue;
            }
            if name == "bloomgate" && container == admin_port {
                admin_published += 1;
            }
            assert!(
                matches!(ip.as_deref(), Some("127.0.0.1") | Some("::1")),
                "{name} publishes {host}:{container} on every interface: {entry:?}"
            );
        }
    }
    assert_eq!(admin_published, 1, "the admin plane is published once");
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
