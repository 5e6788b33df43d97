//! The files an operator ships, checked without a container engine or a cluster: the
//! Dockerfile read instruction by instruction (stages, user, data volume, no baked
//! configuration or secret, a health check that follows `admin.listen`), its health
//! check script run against real sockets, docker-compose.yml's shape (one build shared
//! by both instances, health-gated start order, restart policies, memory limits, no
//! literal secret), the systemd unit through `systemd-analyze verify`, the Kubernetes
//! manifests against the Kubernetes schemas (`kubernetes-validate`, offline) and against
//! the configuration they carry, the licences, and the real binary's `sd_notify`
//! notices on a socket the test binds.
//!
//! `systemd-analyze` and a Python with `kubernetes_validate` are installed by
//! `scripts/test`; without them these tests are skipped, and fail when `CI` is set.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use bloomgate::config::{Config, OutcomeHeaderPolicy};
use support::binary::{BIN, Bloomgate, message};

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// Whether `CI` is set to something other than the empty string.
fn ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// Says once, on the process's stderr, that a test is skipped (libtest captures
/// `eprintln!`), after failing instead when `CI` is set.
fn skip(what: &str) {
    assert!(
        !ci(),
        "{what} but CI is set: run the tests through scripts/test"
    );
    let _ = writeln!(
        std::io::stderr(),
        "skipping: {what} (scripts/test installs it)"
    );
}

// ---------------------------------------------------------------------------------------
// Dockerfile

/// One Dockerfile instruction: its keyword (upper case), its flags (`--from=builder`) and
/// the rest of the line, continuation lines joined.
#[derive(Debug, Clone)]
struct Instruction {
    keyword: String,
    flags: Vec<String>,
    args: String,
}

impl Instruction {
    /// The arguments as words: a JSON array's items, or the words of the shell form.
    fn words(&self) -> Vec<String> {
        let args = self.args.trim();
        if args.starts_with('[') {
            serde_json::from_str(args)
                .unwrap_or_else(|e| panic!("{} {args}: not a JSON array: {e}", self.keyword))
        } else {
            args.split_whitespace().map(str::to_owned).collect()
        }
    }
}

/// The instructions of a Dockerfile, by build stage (a stage starts at each `FROM`).
fn dockerfile_stages(text: &str) -> Vec<Vec<Instruction>> {
    let mut logical = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                logical.push(std::mem::take(&mut current));
            }
        }
    }
    assert!(
        current.is_empty(),
        "the Dockerfile ends inside an instruction"
    );
    let mut stages: Vec<Vec<Instruction>> = Vec::new();
    for line in logical.into_iter().filter(|l| !l.trim().is_empty()) {
        let (keyword, rest) = line.split_once(char::is_whitespace).unwrap_or((&line, ""));
        let mut rest = rest.trim();
        let mut flags = Vec::new();
        while let Some(flagged) = rest.strip_prefix("--") {
            let (flag, after) = flagged
                .split_once(char::is_whitespace)
                .unwrap_or((flagged, ""));
            flags.push(flag.to_owned());
            rest = after.trim_start();
        }
        let instruction = Instruction {
            keyword: keyword.to_ascii_uppercase(),
            flags,
            args: rest.to_owned(),
        };
        if instruction.keyword == "FROM" {
            stages.push(Vec::new());
        }
        stages
            .last_mut()
            .expect("the Dockerfile starts with FROM")
            .push(instruction);
    }
    stages
}

fn all<'s>(stage: &'s [Instruction], keyword: &str) -> Vec<&'s Instruction> {
    stage.iter().filter(|i| i.keyword == keyword).collect()
}

fn one<'s>(stage: &'s [Instruction], keyword: &str) -> &'s Instruction {
    let found = all(stage, keyword);
    assert_eq!(
        found.len(),
        1,
        "one {keyword} in the runtime stage: {found:?}"
    );
    found[0]
}

/// A name that says it holds a secret.
fn secret_looking(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    [
        "TOKEN",
        "PASSWORD",
        "PASSWD",
        "SECRET",
        "CREDENTIAL",
        "API_KEY",
        "PRIVATE",
    ]
    .iter()
    .any(|s| upper.contains(s))
}

/// The path the configuration is mounted at in the image, and read from by `serve`.
const IMAGE_CONFIG: &str = "/etc/bloomgate/config.toml";

#[test]
fn the_dockerfile_builds_a_stripped_binary_and_runs_it_unprivileged_with_nothing_baked_in() {
    let dockerfile = read("Dockerfile");
    let stages = dockerfile_stages(&dockerfile);
    assert!(stages.len() >= 2, "a multi-stage build");
    let builder = &stages[0];
    let runtime = stages.last().expect("a runtime stage");

    // The builder is named, builds from Cargo.lock, and strips what it hands over.
    let builder_name = builder[0]
        .args
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .find(|w| w[0].eq_ignore_ascii_case("AS"))
        .map(|w| w[1].to_owned())
        .expect("FROM ... AS name");
    let build = all(builder, "RUN")
        .into_iter()
        .map(|r| r.args.clone())
        .find(|r| r.contains("cargo build"))
        .expect("a cargo build");
    assert!(
        build.contains("--release") && build.contains("--locked"),
        "{build}"
    );
    assert!(build.contains("strip"), "the binary is stripped: {build}");

    // The runtime: Debian 12 slim at a point release.
    let base = runtime[0].args.trim();
    let tag = base.strip_prefix("debian:").expect("a Debian runtime");
    let version = tag.strip_suffix("-slim").expect("the slim variant");
    let (major, point) = version.split_once('.').expect("a point tag: 12.N");
    assert_eq!(major, "12", "{base}");
    assert!(point.parse::<u32>().is_ok(), "a point tag: {base}");
    let copied_binary = all(runtime, "COPY").into_iter().any(|c| {
        c.flags.contains(&format!("from={builder_name}"))
            && c.words().last().map(String::as_str) == Some("/usr/local/bin/bloomgate")
    });
    assert!(
        copied_binary,
        "the binary comes from the {builder_name} stage"
    );

    // An unprivileged user, by number.
    let user = one(runtime, "USER").args.trim().to_owned();
    let uid = user.split(':').next().unwrap_or_default();
    assert!(
        uid.parse::<u32>().is_ok_and(|uid| uid != 0),
        "USER by non-zero number: {user}"
    );

    // Snapshots and other relative paths land on a volume the user owns.
    let workdir = one(runtime, "WORKDIR").args.trim().to_owned();
    assert_eq!(workdir, "/var/lib/bloomgate");
    let volumes = one(runtime, "VOLUME").words();
    assert_eq!(volumes, std::slice::from_ref(&workdir));
    let owned = all(runtime, "RUN").into_iter().any(|r| {
        r.args.contains(&format!(
            "install -d -o bloomgate -g bloomgate -m 0750 {workdir}"
        ))
    });
    assert!(owned, "{workdir} is created owned by the user");
    assert!(
        dockerfile.contains(&format!("--uid {uid} ")),
        "the user has uid {uid}"
    );

    // No secret anywhere in a layer: no secret-looking ENV or ARG in any stage, no
    // token value, and the build context leaves .env out.
    for instruction in stages.iter().flatten() {
        if matches!(instruction.keyword.as_str(), "ENV" | "ARG" | "LABEL") {
            let name = instruction
                .args
                .split(['=', ' '])
                .next()
                .unwrap_or_default();
            assert!(
                !secret_looking(name),
                "{} {} puts a secret in the image",
                instruction.keyword,
                instruction.args
            );
        }
        assert!(
            !instruction.args.contains("BLOOMGATE__ADMIN__TOKEN"),
            "{instruction:?}"
        );
    }
    let ignored: Vec<String> = read(".dockerignore").lines().map(str::to_owned).collect();
    for path in [".env", "target/", ".git/"] {
        assert!(
            ignored.iter().any(|l| l == path),
            ".dockerignore lacks {path}"
        );
    }

    // The configuration is mounted, not baked: the image carries the example only, at
    // another name than the one `serve` reads.
    let mut copied_into_etc = Vec::new();
    for copy in all(runtime, "COPY") {
        let words = copy.words();
        let (dest, sources) = words.split_last().expect("COPY src dest");
        for source in sources {
            if !copy.flags.iter().any(|f| f.starts_with("from=")) {
                assert!(repo(source).exists(), "COPY of missing {source}");
            }
        }
        if dest.starts_with("/etc/bloomgate") {
            copied_into_etc.push((sources.to_vec(), dest.clone()));
        }
    }
    assert_eq!(
        copied_into_etc,
        [(
            vec!["config.compose.toml".to_owned()],
            "/etc/bloomgate/config.example.toml".to_owned()
        )]
    );
    let entrypoint = one(runtime, "ENTRYPOINT").words();
    let cmd = one(runtime, "CMD").words();
    assert_eq!(entrypoint, ["bloomgate"]);
    assert_eq!(cmd, ["serve", "--config", IMAGE_CONFIG]);

    // The health check reads admin.listen from that same file, with the script copied
    // in from the repository; the example's admin port is exposed.
    let health = one(runtime, "HEALTHCHECK");
    let check = health
        .args
        .strip_prefix("CMD")
        .map(str::trim)
        .expect("HEALTHCHECK CMD [...]");
    let check: Vec<String> = serde_json::from_str(check).expect("exec form");
    assert_eq!(check, ["bloomgate-healthcheck", IMAGE_CONFIG, "/readyz"]);
    let script_copied = all(runtime, "COPY").into_iter().any(|c| {
        c.words()
            == [
                "deploy/docker/healthcheck",
                "/usr/local/bin/bloomgate-healthcheck",
            ]
    });
    assert!(script_copied, "the health check script is in the image");
    let example = Config::from_toml_str(&read("config.compose.toml")).expect("valid example");
    let exposed = one(runtime, "EXPOSE").words();
    for port in [example.server.listen.port(), example.admin.listen.port()] {
        assert!(
            exposed.contains(&port.to_string()),
            "port {port} exposed: {exposed:?}"
        );
    }
    assert!(
        example.admin.listen.ip().is_unspecified(),
        "the example's admin plane is reachable from Prometheus in another container"
    );
    assert_eq!(example.admin.token, None, "no token in the example");
}

#[test]
fn the_dockerfile_reader_sees_what_it_must_refuse() {
    let stages = dockerfile_stages(
        "# comment\nFROM a AS b\nRUN x \\\n  && y\nFROM c\nCOPY --from=b /x /y\nENV TOKEN=1\n",
    );
    assert_eq!(stages.len(), 2);
    assert_eq!(stages[0][1].args, "x  && y");
    assert_eq!(stages[1][1].flags, ["from=b"]);
    assert_eq!(stages[1][1].words(), ["/x", "/y"]);
    assert!(secret_looking(
        stages[1][2].args.split('=').next().unwrap_or_default()
    ));
    assert!(!secret_looking("RUST_LOG"));
}

/// A loopback server answering every connection with `status` until dropped.
struct StubAdmin {
    addr: SocketAddr,
}

impl StubAdmin {
    fn start(status: u16) -> StubAdmin {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { break };
                // The whole head, as an HTTP server reads it, before answering.
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.ends_with(b"\r\n\r\n") {
                    match stream.read(&mut buf) {
                        Ok(n) if n > 0 => head.extend_from_slice(&buf[..n]),
                        _ => break,
                    }
                }
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
            }
        });
        StubAdmin { addr }
    }
}

/// Runs the image's health check script; whether it passed.
fn health_check(config: &Path, env: &[(&str, &str)]) -> bool {
    let mut cmd = Command::new("bash");
    cmd.arg(repo("deploy/docker/healthcheck"))
        .arg(config)
        .arg("/readyz")
        .env_remove("BLOOMGATE__ADMIN__LISTEN")
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    let out = cmd.output().expect("run bash");
    if !out.status.success() {
        // Said on the test's output, for when a healthy stub is judged unhealthy.
        println!(
            "health check on {}: {}",
            config.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out.status.success()
}

/// A port nothing listens on (bound, then let go).
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

#[test]
fn the_health_check_follows_admin_listen_in_the_mounted_config() {
    let ready = StubAdmin::start(200);
    let loading = StubAdmin::start(503);
    let dir = tempfile::tempdir().expect("temp dir");
    let example = read("config.compose.toml");
    let admin = Config::from_toml_str(&example)
        .expect("valid example")
        .admin
        .listen;
    let config_at = |name: &str, port: u16| {
        // The example itself, its admin port moved: the script reads the real file.
        let text = example.replacen(
            &format!("listen = \"{admin}\""),
            &format!("listen = \"0.0.0.0:{port}\""),
            1,
        );
        assert_ne!(text, example, "the example names admin.listen as {admin}");
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write config");
        path
    };
    let to_ready = config_at("ready.toml", ready.addr.port());
    let to_loading = config_at("loading.toml", loading.addr.port());
    let to_nothing = config_at("nothing.toml", closed_port());
    assert!(health_check(&to_ready, &[]), "200 on /readyz: healthy");
    assert!(!health_check(&to_loading, &[]), "503: not healthy");
    assert!(!health_check(&to_nothing, &[]), "nothing listening");
    // The environment overrides the file, as it does for bloomgate.
    let env = ready.addr.to_string();
    assert!(health_check(
        &to_nothing,
        &[("BLOOMGATE__ADMIN__LISTEN", env.as_str())]
    ));
    let env = loading.addr.to_string();
    assert!(!health_check(
        &to_ready,
        &[("BLOOMGATE__ADMIN__LISTEN", env.as_str())]
    ));
    // The data plane's `listen`, in [server], is not mistaken for the admin plane's.
    let server_first = dir.path().join("server-first.toml");
    std::fs::write(
        &server_first,
        format!(
            "[server]\nlisten = \"0.0.0.0:{}\"\n\n[admin] # the admin plane\n  listen = \"0.0.0.0:{}\"\n",
            ready.addr.port(),
            loading.addr.port()
        ),
    )
    .expect("write");
    assert!(!health_check(&server_first, &[]));
}

// ---------------------------------------------------------------------------------------
// docker-compose.yml

/// docker-compose.yml as compose reads it: `<<` merge keys applied.
fn compose() -> serde_yaml::Value {
    let mut doc: serde_yaml::Value =
        serde_yaml::from_str(&read("docker-compose.yml")).expect("docker-compose.yml is YAML");
    doc.apply_merge().expect("merge keys");
    doc
}

/// The `${NAME...}` references in a text: each variable name and what follows it.
fn variables(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        let inner = &rest[at + 2..];
        let end = inner.find('}').expect("a closed ${...}");
        let reference = &inner[..end];
        let name_end = reference
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(reference.len());
        out.push((
            reference[..name_end].to_owned(),
            reference[name_end..].to_owned(),
        ));
        rest = &inner[end..];
    }
    out
}

#[test]
fn compose_shares_one_build_gates_start_order_on_health_and_bounds_every_service() {
    let text = read("docker-compose.yml");
    let compose = compose();
    let services = compose["services"].as_mapping().expect("services");
    let instances = ["bloomgate-1", "bloomgate-2"];

    // One build, written once, shared through the x-bloomgate anchor.
    assert!(text.contains("x-bloomgate: &bloomgate\n"));
    assert_eq!(text.matches("<<: *bloomgate\n").count(), instances.len());
    assert_eq!(text.matches("build:").count(), 1, "one build section");
    let images: BTreeSet<(String, String)> = instances
        .iter()
        .map(|name| {
            let service = &compose["services"][name];
            (
                service["build"].as_str().unwrap_or_default().to_owned(),
                service["image"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        images,
        BTreeSet::from([(".".to_owned(), "bloomgate:local".to_owned())])
    );

    // The configuration is mounted from the repository, read-only, where `serve` reads
    // it; the admin token is a secret file named by admin.token_file.
    for name in instances {
        let service = &compose["services"][name];
        let volumes: Vec<&str> = service["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert!(
            volumes.contains(&"./config.compose.toml:/etc/bloomgate/config.toml:ro"),
            "{name}: {volumes:?}"
        );
        assert_eq!(
            service["environment"]["BLOOMGATE__ADMIN__TOKEN_FILE"].as_str(),
            Some("/run/secrets/admin_token")
        );
        assert_eq!(service["secrets"][0].as_str(), Some("admin_token"));
    }
    assert_eq!(
        compose["secrets"]["admin_token"]["environment"].as_str(),
        Some("BLOOMGATE_ADMIN_TOKEN")
    );

    // Every service restarts on its own and has a memory limit.
    for (name, service) in services {
        let name = name.as_str().unwrap_or_default();
        assert_eq!(
            service["restart"].as_str(),
            Some("unless-stopped"),
            "{name} restarts"
        );
        let limit = service["mem_limit"].as_str().unwrap_or_default();
        assert!(
            limit.ends_with('m') || limit.ends_with('g'),
            "{name} has a memory limit: {limit:?}"
        );
    }

    // Start order waits on health, and every service waited on has a health check (the
    // instances' comes from the Dockerfile).
    let dockerfile_health = dockerfile_stages(&read("Dockerfile"))
        .last()
        .is_some_and(|s| s.iter().any(|i| i.keyword == "HEALTHCHECK"));
    let mut waited_on = BTreeSet::new();
    for (name, service) in services {
        if let Some(deps) = service["depends_on"].as_mapping() {
            for (dep, how) in deps {
                let dep = dep.as_str().expect("a service name");
                if how["condition"].as_str() == Some("service_healthy") {
                    waited_on.insert(dep.to_owned());
                }
                assert!(services.contains_key(dep), "{name:?} depends on {dep}");
            }
        }
    }
    for dep in &waited_on {
        let service = &compose["services"][dep.as_str()];
        let checked = !service["healthcheck"].is_null()
            || (service["build"].as_str() == Some(".") && dockerfile_health);
        assert!(checked, "{dep} is waited on but has no health check");
    }
    for name in instances {
        assert!(
            waited_on.contains(name),
            "the load balancer waits on {name}"
        );
    }
    let lb = &compose["services"]["lb"];
    for name in instances {
        assert_eq!(
            lb["depends_on"][name]["condition"].as_str(),
            Some("service_healthy")
        );
    }

    // No literal secret: each secret-looking variable's value, and each URL's password,
    // is a required variable from the environment (or names a file).
    let example_env = read(".env.example");
    let declared: BTreeSet<&str> = example_env
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('=').map(|(k, _)| k))
        .collect();
    for (name, service) in services {
        let Some(env) = service["environment"].as_mapping() else {
            continue;
        };
        for (var, value) in env {
            let var = var.as_str().unwrap_or_default();
            let value = value.as_str().unwrap_or_default();
            if secret_looking(var) && !var.ends_with("_FILE") {
                assert!(
                    value.starts_with("${") && value.ends_with('}'),
                    "{name:?}: {var} is written in the file"
                );
            }
            if let Some((_, after_scheme)) = value.split_once("://")
                && let Some((credentials, _)) = after_scheme.split_once('@')
                && let Some((_, password)) = credentials.split_once(':')
            {
                assert!(
                    password.starts_with("${"),
                    "{name:?}: {var} has a literal password"
                );
            }
        }
    }
    for (name, rest) in variables(&text) {
        assert!(
            rest.starts_with(":?"),
            "${{{name}}} must be set, not defaulted: {rest}"
        );
        assert!(
            declared.contains(name.as_str()),
            ".env.example lacks {name}"
        );
    }
    for line in example_env.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            line.is_empty() || line.ends_with('='),
            ".env.example gives a value: {line}"
        );
    }
    assert!(
        read(".gitignore").lines().any(|l| l == "/.env"),
        ".env is not committed"
    );

    // Redis: no default user, a user of bloomgate's with a password from the
    // environment, limited to the fleet's namespace (docs/fleet.md).
    let command: Vec<String> = compose["services"]["redis"]["command"]
        .as_sequence()
        .expect("a command list")
        .iter()
        .map(|a| a.as_str().expect("text").to_owned())
        .collect();
    let users = redis_users(&command);
    assert_eq!(users[0], ["default", "off"]);
    let config = Config::from_toml_str(&read("config.compose.toml")).expect("valid");
    let namespace =
        compose["services"]["bloomgate-1"]["environment"]["BLOOMGATE__FLEET__NAMESPACE"]
            .as_str()
            .expect("a namespace");
    let user = &users[1];
    assert_eq!(user[..2], ["bloomgate", "on"]);
    assert!(user[2].starts_with(">${REDIS_PASSWORD:?"), "{user:?}");
    // The key patterns are the documented ones with the namespace in place of the
    // default: the fleet's keys `{ns}:...`, the shards of a Redis-held filter `{ns:...`.
    let patterns: BTreeSet<String> = user
        .iter()
        .filter(|w| w.starts_with('~'))
        .cloned()
        .collect();
    let documented_patterns: BTreeSet<String> = read("docs/fleet.md")
        .lines()
        .find(|l| l.trim_start().starts_with("ACL SETUSER bloomgate"))
        .expect("docs/fleet.md's ACL rule")
        .split_whitespace()
        .filter(|w| w.starts_with('~'))
        .map(|w| w.replace("{bloomgate", &format!("{{{namespace}")))
        .collect();
    assert!(user.contains(&"resetkeys".to_owned()), "{user:?}");
    assert_eq!(patterns, documented_patterns);
    assert!(
        patterns.contains(&format!("~{{{namespace}}}:*")),
        "{patterns:?}"
    );
    // The commands docs/fleet.md gives bloomgate's user, and PING for the health check.
    let fleet_doc = read("docs/fleet.md");
    let documented = fleet_doc
        .lines()
        .find(|l| l.trim_start().starts_with("ACL SETUSER bloomgate"))
        .expect("docs/fleet.md's ACL rule");
    let granted = |words: &mut dyn Iterator<Item = &str>| -> BTreeSet<String> {
        words
            .filter(|w| w.starts_with('+') || w.starts_with('-'))
            .map(str::to_owned)
            .collect()
    };
    let mut expected = granted(&mut documented.split_whitespace());
    expected.insert("+ping".to_owned());
    assert_eq!(granted(&mut user.iter().map(String::as_str)), expected);
    let health = compose["services"]["redis"]["healthcheck"]["test"][1]
        .as_str()
        .unwrap_or_default();
    assert!(
        health.contains("--user bloomgate") && health.contains("$$REDIS_PASSWORD"),
        "{health}"
    );

    // The outcome header goes to trusted clients only, and the instances believe the
    // load balancer's forwarded headers, at its fixed address in the fixed subnet.
    let lb_ip: std::net::IpAddr = lb["networks"]["default"]["ipv4_address"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .expect("a fixed address for the load balancer");
    let subnet: ipnet::IpNet = compose["networks"]["default"]["ipam"]["config"][0]["subnet"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("a fixed subnet");
    assert!(subnet.contains(&lb_ip));
    assert_eq!(config.server.trusted_proxies, [lb_ip.to_string()]);
    assert_eq!(config.server.outcome_header, OutcomeHeaderPolicy::Trusted);

    // nginx finds a recreated instance: Docker's DNS, asked again while running.
    let nginx = read("deploy/nginx/bloomgate.conf");
    assert!(
        nginx.contains("\nresolver 127.0.0.11 "),
        "Docker's resolver"
    );
    assert!(nginx.contains("\n    zone bloomgate "), "a shared zone");
    for name in instances {
        assert!(
            nginx.contains(&format!("server {name}:8080 resolve ")),
            "{name} is resolved again"
        );
    }
    let tag = lb["image"].as_str().unwrap_or_default();
    let version: Vec<u32> = tag
        .trim_start_matches("nginx:")
        .split('.')
        .map(|p| p.parse().expect("a numeric tag"))
        .collect();
    assert!(
        version.as_slice() >= [1, 27, 3].as_slice(),
        "`resolve` in an upstream needs nginx 1.27.3: {tag}"
    );
}

/// The rules of each `--user` of a redis-server command line, word by word.
fn redis_users(command: &[String]) -> Vec<Vec<String>> {
    let mut users: Vec<Vec<String>> = Vec::new();
    let mut inside = false;
    for word in command {
        if word.starts_with("--") {
            inside = word == "--user";
            if inside {
                users.push(Vec::new());
            }
        } else if inside && let Some(user) = users.last_mut() {
            user.push(word.clone());
        }
    }
    users
}

#[test]
fn the_variable_reader_finds_each_reference() {
    assert_eq!(
        variables("a ${X:?set it} b ${Y_2} ${Z:-d}"),
        [
            ("X".to_owned(), ":?set it".to_owned()),
            ("Y_2".to_owned(), String::new()),
            ("Z".to_owned(), ":-d".to_owned())
        ]
    );
}

// ---------------------------------------------------------------------------------------
// systemd

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify_and_is_hardened() {
    let unit = read("deploy/systemd/bloomgate.service");
    let settings: Vec<(String, String)> = unit
        .lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let get = |key: &str| -> Vec<&str> {
        settings
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    };
    for (key, value) in [
        ("Type", "notify"),
        ("NotifyAccess", "main"),
        ("DynamicUser", "yes"),
        ("ProtectSystem", "strict"),
        ("StateDirectory", "bloomgate"),
        ("WorkingDirectory", "%S/bloomgate"),
        ("NoNewPrivileges", "yes"),
        ("CapabilityBoundingSet", ""),
        ("ExecReload", "/bin/kill -HUP $MAINPID"),
        ("Environment", "BLOOMGATE__ADMIN__TOKEN_FILE=%d/admin-token"),
    ] {
        assert_eq!(get(key), [value], "{key}");
    }
    let start = get("ExecStart");
    assert_eq!(
        start,
        ["/usr/local/bin/bloomgate serve --config /etc/bloomgate/config.toml"]
    );
    // The stop timeout leaves shutdown_grace (the default, or the example's) to drain.
    let stop = humantime::parse_duration(get("TimeoutStopSec")[0]).expect("a duration");
    let example = Config::from_toml_str(&read("config.toml")).expect("config.toml");
    let defaults = Config::from_toml_str("").expect("an empty config");
    assert!(stop > example.server.shutdown_grace && stop > defaults.server.shutdown_grace);

    let Some(analyze) = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
    else {
        skip("systemd-analyze not found");
        return;
    };
    // verify also checks that each command exists: this build's binary stands in for
    // the installed one.
    let dir = tempfile::tempdir().expect("temp dir");
    let copy = dir.path().join("bloomgate.service");
    std::fs::write(&copy, unit.replace("/usr/local/bin/bloomgate", BIN)).expect("write");
    let verify = |path: &Path| {
        let out = Command::new(&analyze)
            .args(["verify", "--man=no"])
            .arg(path)
            .env("SYSTEMD_LOG_COLOR", "0")
            .output()
            .expect("run systemd-analyze");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, text) = verify(&copy);
    assert!(
        ok && text.trim().is_empty(),
        "systemd-analyze verify:\n{text}"
    );
    // A unit it must object to: a misspelt key is a warning, which the check above
    // would see.
    std::fs::write(
        &copy,
        unit.replace("DynamicUser=", "DynamicUsr=")
            .replace("/usr/local/bin/bloomgate", BIN),
    )
    .expect("write");
    let (_, text) = verify(&copy);
    assert!(text.contains("DynamicUsr"), "{text}");
}

// ---------------------------------------------------------------------------------------
// Kubernetes

/// Every document of every manifest under deploy/kubernetes, by file name.
fn manifests() -> Vec<(String, serde_yaml::Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo("deploy/kubernetes"))
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    let mut out = Vec::new();
    for path in files {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        assert!(name.ends_with(".yaml"), "{name}: manifests end in .yaml");
        let text = std::fs::read_to_string(&path).expect("read manifest");
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_yaml::Value::deserialize(doc).expect("YAML");
            if !value.is_null() {
                out.push((name.clone(), value));
            }
        }
    }
    out
}

use serde::Deserialize as _;

fn kind<'m>(
    manifests: &'m [(String, serde_yaml::Value)],
    kind: &str,
    name: &str,
) -> &'m serde_yaml::Value {
    manifests
        .iter()
        .map(|(_, m)| m)
        .find(|m| m["kind"].as_str() == Some(kind) && m["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// A Python that can import `kubernetes_validate`: `BLOOMGATE_TEST_PYTHON` (which
/// `scripts/test` exports), else `python3`.
fn python_with_kubernetes_validate() -> Option<String> {
    let python = std::env::var("BLOOMGATE_TEST_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".to_owned());
    let ok = Command::new(&python)
        .args(["-c", "import kubernetes_validate"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        Some(python)
    } else {
        skip(&format!("{python} cannot import kubernetes_validate"));
        None
    }
}

/// The Kubernetes version the manifests are checked against: the oldest still in
/// upstream support when they were written.
const KUBERNETES_VERSION: &str = "1.30.0";

#[test]
fn every_kubernetes_manifest_passes_the_schemas_offline() {
    let Some(python) = python_with_kubernetes_validate() else {
        return;
    };
    let files: Vec<PathBuf> = std::fs::read_dir(repo("deploy/kubernetes"))
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").path())
        .collect();
    let validate = |files: &[PathBuf]| {
        let out = Command::new(&python)
            .args(["-m", "kubernetes_validate", "--strict", "--no-warn"])
            .args(["--kubernetes-version", KUBERNETES_VERSION])
            .args(files)
            .output()
            .expect("run kubernetes_validate");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, text) = validate(&files);
    assert!(ok, "{text}");
    let documents = manifests().len();
    assert_eq!(
        text.matches(" passed for resource ").count(),
        documents,
        "every document checked:\n{text}"
    );
    // The same check refuses a manifest with a misspelt field.
    let dir = tempfile::tempdir().expect("temp dir");
    let bad = dir.path().join("deployment.yaml");
    std::fs::write(
        &bad,
        read("deploy/kubernetes/deployment.yaml").replace("readinessProbe:", "readynessProbe:"),
    )
    .expect("write");
    let (ok, text) = validate(&[bad]);
    assert!(!ok, "{text}");
}

#[test]
fn the_kubernetes_deployment_runs_a_fleet_that_drains_within_its_grace() {
    let manifests = manifests();
    let config_map = kind(&manifests, "ConfigMap", "bloomgate-config");
    let config_text = config_map["data"]["config.toml"]
        .as_str()
        .expect("config.toml in the ConfigMap");
    let config = Config::from_toml_str(config_text).expect("the ConfigMap's config is valid");
    assert!(config.fleet.is_some(), "fleet mode");
    assert_eq!(config.admin.token, None, "no token in the ConfigMap");
    assert!(
        !config_text.contains('@') || config_text.contains("mysql://bloomgate@"),
        "no password in the ConfigMap"
    );

    let deployment = kind(&manifests, "Deployment", "bloomgate");
    assert_eq!(deployment["spec"]["replicas"].as_u64(), Some(2));
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];

    // Probes on the admin plane's port.
    let admin_port = container["ports"]
        .as_sequence()
        .expect("ports")
        .iter()
        .find(|p| p["name"].as_str() == Some("admin"))
        .and_then(|p| p["containerPort"].as_u64())
        .expect("an admin port");
    assert_eq!(admin_port, u64::from(config.admin.listen.port()));
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(container[probe]["httpGet"]["path"].as_str(), Some(path));
        assert_eq!(container[probe]["httpGet"]["port"].as_str(), Some("admin"));
    }

    // preStop sleeps while endpoints are removed; then SIGTERM, and shutdown_grace to
    // drain, all within terminationGracePeriodSeconds.
    let pre_stop: Vec<&str> = container["lifecycle"]["preStop"]["exec"]["command"]
        .as_sequence()
        .expect("a preStop command")
        .iter()
        .filter_map(|w| w.as_str())
        .collect();
    let [sleep, seconds] = pre_stop.as_slice() else {
        panic!("preStop: sleep N, got {pre_stop:?}");
    };
    assert_eq!(*sleep, "sleep");
    let pre_stop = Duration::from_secs(seconds.parse().expect("whole seconds"));
    let grace = Duration::from_secs(
        pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("terminationGracePeriodSeconds"),
    );
    assert!(pre_stop >= Duration::from_secs(3), "{pre_stop:?}");
    assert!(
        grace > pre_stop + config.server.shutdown_grace,
        "{grace:?} leaves {pre_stop:?} + shutdown_grace {:?}",
        config.server.shutdown_grace
    );
    assert!(
        grace <= pre_stop + config.server.shutdown_grace + Duration::from_secs(10),
        "{grace:?} is far beyond what a drain takes"
    );

    // Resources, scraping, a non-root user, secrets from the Secret.
    for key in ["requests", "limits"] {
        assert!(
            container["resources"][key]["memory"].as_str().is_some(),
            "resources.{key}.memory"
        );
    }
    let annotations = &deployment["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"].as_str(), Some("true"));
    assert_eq!(
        annotations["prometheus.io/port"].as_str(),
        Some(admin_port.to_string().as_str())
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    let env: BTreeMap<&str, &serde_yaml::Value> = container["env"]
        .as_sequence()
        .expect("env")
        .iter()
        .map(|e| (e["name"].as_str().expect("a name"), e))
        .collect();
    assert_eq!(
        env["BLOOMGATE__DATABASE__URL"]["valueFrom"]["secretKeyRef"]["name"].as_str(),
        Some("bloomgate")
    );
    let token_file = env["BLOOMGATE__ADMIN__TOKEN_FILE"]["value"]
        .as_str()
        .expect("a token file");
    let mount = container["volumeMounts"]
        .as_sequence()
        .expect("mounts")
        .iter()
        .find(|m| m["name"].as_str() == Some("admin-token"))
        .and_then(|m| m["mountPath"].as_str())
        .expect("the token's mount");
    assert!(token_file.starts_with(&format!("{mount}/")), "{token_file}");
    assert_eq!(
        env["BLOOMGATE__FLEET__INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("metadata.name"),
        "each replica its own id"
    );
    for (var, value) in &env {
        if secret_looking(var) && !var.ends_with("_FILE") {
            assert!(value["value"].is_null(), "{var} written in the manifest");
        }
    }

    // The ConfigMap's file with the Deployment's environment is what a pod runs: it
    // passes check-config with real values in the Secret, and is refused with the
    // Secret as shipped (empty values).
    let dir = tempfile::tempdir().expect("temp dir");
    let config_path = dir.path().join("config.toml");
    std::fs::write(&config_path, config_text).expect("write config");
    let pod_env = |secret: &dyn Fn(&str) -> String| -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        // In the manifest's order: a reference sees only the variables before it.
        for entry in container["env"].as_sequence().expect("env") {
            let var = entry["name"].as_str().expect("a name");
            let value = if let Some(value) = entry["value"].as_str() {
                // $(NAME) refers to a variable defined before, as the kubelet expands it.
                let mut value = value.to_owned();
                for (name, earlier) in &out {
                    value = value.replace(&format!("$({name})"), earlier);
                }
                value
            } else if let Some(key) = entry["valueFrom"]["secretKeyRef"]["key"].as_str() {
                secret(key)
            } else if entry["valueFrom"]["fieldRef"]["fieldPath"].as_str() == Some("metadata.name")
            {
                "bloomgate-7c9d8f6b5-x2x7k".to_owned()
            } else {
                panic!("{var}: an unexpected source");
            };
            out.push(((*var).to_owned(), value));
        }
        out
    };
    // The token file is the Secret's key, as the volume mounts it.
    let check = |secret: &dyn Fn(&str) -> String| {
        let token = dir.path().join("admin-token");
        std::fs::write(&token, secret("admin-token")).expect("write token");
        let mut cmd = Command::new(BIN);
        cmd.args(["check-config", "--config"])
            .arg(&config_path)
            .stdin(Stdio::null());
        for (var, _) in std::env::vars_os() {
            if var.to_string_lossy().starts_with("BLOOMGATE__") {
                cmd.env_remove(var);
            }
        }
        for (var, value) in pod_env(secret) {
            let value = if var == "BLOOMGATE__ADMIN__TOKEN_FILE" {
                token.display().to_string()
            } else {
                value
            };
            cmd.env(var, value);
        }
        let out = cmd.output().expect("run check-config");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let filled = |key: &str| match key {
        "database-url" => "mysql://bloomgate:db-password@mysql:3306/shop".to_owned(),
        "redis-password" => "redis-password".to_owned(),
        "admin-token" => "an-admin-token\n".to_owned(),
        other => panic!("the Secret has no {other}"),
    };
    let (code, text) = check(&filled);
    assert_eq!(code, Some(0), "{text}");
    let redis_url = pod_env(&filled)
        .into_iter()
        .find(|(var, _)| var == "BLOOMGATE__FLEET__REDIS_URL")
        .map(|(_, url)| url);
    assert_eq!(
        redis_url.as_deref(),
        Some("redis://:redis-password@redis:6379")
    );
    let secret = kind(&manifests, "Secret", "bloomgate");
    let shipped = |key: &str| {
        secret["stringData"][key]
            .as_str()
            .unwrap_or_else(|| panic!("the Secret has no {key}"))
            .to_owned()
    };
    let (code, text) = check(&shipped);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("database.url") && text.contains("admin.token_file"),
        "{text}"
    );

    // A disruption budget that keeps one replica serving.
    let pdb = kind(&manifests, "PodDisruptionBudget", "bloomgate");
    assert_eq!(pdb["spec"]["minAvailable"].as_u64(), Some(1));
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );
    // Redis, never evicting, with a password.
    let redis = kind(&manifests, "StatefulSet", "redis");
    let args: Vec<&str> = redis["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_sequence()
        .expect("redis args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert!(
        args.windows(2)
            .any(|w| w == ["--maxmemory-policy", "noeviction"])
    );
    assert!(
        args.windows(2)
            .any(|w| w == ["--requirepass", "$(REDIS_PASSWORD)"])
    );
    // The Secret ships without values.
    for (key, value) in secret["stringData"].as_mapping().expect("stringData") {
        assert_eq!(value.as_str(), Some(""), "{key:?} has a value");
    }
}

// ---------------------------------------------------------------------------------------
// Release files

#[test]
fn both_licences_and_a_changelog_ship() {
    let manifest = read("Cargo.toml");
    assert!(manifest.contains("license = \"MIT OR Apache-2.0\""));
    let mit = read("LICENSE-MIT");
    assert!(mit.starts_with("MIT License") && mit.contains("THE SOFTWARE IS PROVIDED \"AS IS\""));
    let apache = read("LICENSE-APACHE");
    assert!(apache.contains("Apache License") && apache.contains("Version 2.0, January 2004"));
    assert!(apache.contains("END OF TERMS AND CONDITIONS"));
    let changelog = read("CHANGELOG.md");
    assert!(changelog.starts_with("# Changelog"));
    assert!(changelog.contains("\n## [Unreleased]\n"));
}

// ---------------------------------------------------------------------------------------
// sd_notify

/// Reads one notice from the socket (blocking, with the socket's timeout).
fn notice(socket: &std::os::unix::net::UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    let n = socket
        .recv(&mut buf)
        .expect("a notice within the socket's timeout");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// `POST /admin/reload` on `admin` with `token`: the status.
async fn reload_with(admin: SocketAddr, token: &str) -> u16 {
    let auth = format!("Bearer {token}");
    support::HttpClient::new()
        .send(
            http::Method::POST,
            &format!("http://{admin}/admin/reload"),
            &[("authorization", auth.as_str())],
            bytes::Bytes::new(),
        )
        .await
        .status
        .as_u16()
}

#[tokio::test]
async fn the_binary_tells_systemd_when_it_is_ready_reloading_and_stopping() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket_path = dir.path().join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&socket_path).expect("bind");
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    // The admin token from a file, as a systemd credential gives it.
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, "first-admin-token\n").expect("write the token");
    // A plain proxy in front of an upstream that is never asked: no database needed.
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"1s\"\n\
         [admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n\
         [upstream]\nurl = \"http://127.0.0.1:9\"\n",
        token_file.display()
    );
    let socket_env = socket_path.to_str().expect("a UTF-8 path");
    let mut bin = Bloomgate::serve(&config, &[("NOTIFY_SOCKET", socket_env)]).await;
    let socket = std::sync::Arc::new(socket);
    let next = || {
        let socket = std::sync::Arc::clone(&socket);
        async move {
            tokio::task::spawn_blocking(move || notice(&socket))
                .await
                .expect("reader")
        }
    };

    assert_eq!(next().await, "READY=1\n");
    // Both planes serve by then; the token is the file's, without its line break.
    assert!(std::net::TcpStream::connect(bin.data).is_ok());
    assert_eq!(reload_with(bin.admin, "first-admin-token").await, 200);
    // That reload was not a SIGHUP: systemd is told nothing of it.
    socket
        .set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    assert!(
        socket.recv(&mut buf).is_err(),
        "no notice for an API reload"
    );
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");

    // A rotated token, applied by SIGHUP.
    std::fs::write(&token_file, "second-admin-token\n").expect("rotate the token");
    bin.signal("HUP");
    let reloading = next().await;
    let lines: Vec<&str> = reloading.lines().collect();
    assert_eq!(lines[0], "RELOADING=1", "{reloading}");
    let usec = lines
        .get(1)
        .and_then(|l| l.strip_prefix("MONOTONIC_USEC="))
        .and_then(|v| v.parse::<u64>().ok());
    assert!(usec.is_some_and(|u| u > 0), "{reloading}");
    assert_eq!(next().await, "READY=1\n", "ready again after the reload");
    assert_eq!(reload_with(bin.admin, "first-admin-token").await, 401);
    assert_eq!(reload_with(bin.admin, "second-admin-token").await, 200);

    // A refused reload (the file gone) is still followed by READY=1, and the token in
    // force stays.
    std::fs::remove_file(&token_file).expect("remove the token file");
    bin.signal("HUP");
    assert!(next().await.starts_with("RELOADING=1\n"));
    assert_eq!(next().await, "READY=1\n");
    let refused = bin
        .wait_for_log("the refused reload", Duration::from_secs(10), |l| {
            message(l) == "configuration reload refused; the configuration in force keeps serving"
        })
        .await;
    assert!(
        refused.to_string().contains("admin.token_file"),
        "{refused}"
    );
    // The token is accepted; the reload it asks for is refused like the SIGHUP's.
    assert_eq!(reload_with(bin.admin, "second-admin-token").await, 422);

    bin.signal("TERM");
    assert_eq!(next().await, "STOPPING=1\n");
    assert_eq!(bin.wait_exit(Duration::from_secs(10)).await, Some(0));
}
