//! The data plane's serving threads (`server.threading`): under `per_core` every thread
//! accepts on a listener of its own, all bound to one port with `SO_REUSEPORT`; the bound
//! on open connections and the drain at shutdown span all of them. Every other test runs
//! on the default (`per_core`, one thread per core); these pin the thread count and the
//! model.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::binary::{Bloomgate, message};
use support::{StubUpstream, TestProxy, concurrently, family_series, raw_status, send_raw};

const ACCEPTED: &str = "bloomgate_connections_accepted_total";

fn config(stub: &StubUpstream, server: &[&str]) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n{}\n[admin]\nlisten = \"127.0.0.1:0\"\n\
         [upstream]\nurl = \"{}\"\ntimeout = \"60s\"\n",
        server.join("\n"),
        stub.url()
    )
}

/// `bloomgate_connections_accepted_total` by its `thread` label.
async fn accepted_by_thread(proxy: &TestProxy) -> Vec<(String, f64)> {
    let text = proxy.admin_get("/metrics").await.text();
    family_series(&text, ACCEPTED)
        .iter()
        .map(|line| {
            let thread = line
                .split("thread=\"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap_or_else(|| panic!("no thread label in {line}"))
                .to_owned();
            let value = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no value in {line}"));
            (thread, value)
        })
        .collect()
}

/// 64 connections, one request each, closed by the client's `connection: close`.
async fn one_request_per_connection(proxy: &TestProxy) {
    let data = proxy.data;
    let statuses = concurrently((0..64).collect(), 16, move |i: u32| async move {
        let request = format!("GET /echo/{i} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
        raw_status(&send_raw(data, request.as_bytes()).await)
    })
    .await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_threads_share_one_port_and_the_kernel_spreads_connections() {
    let stub = StubUpstream::start([]).await;
    let proxy =
        TestProxy::spawn(&config(&stub, &["threading = \"per_core\"", "workers = 4"])).await;
    one_request_per_connection(&proxy).await;
    let by_thread = accepted_by_thread(&proxy).await;
    let total: f64 = by_thread.iter().map(|(_, n)| n).sum();
    assert_eq!(total, 64.0, "{by_thread:?}");
    for (thread, _) in &by_thread {
        let index: usize = thread.parse().unwrap_or_else(|_| panic!("thread {thread}"));
        assert!(index < 4, "{by_thread:?}");
    }
    // From 64 connections on fresh source ports, one listener taking all of them would be
    // a chance of 4 · (1/4)^64: it means the others do not accept.
    let busy = by_thread.iter().filter(|(_, n)| *n > 0.0).count();
    assert!(
        busy >= 2,
        "connections reached one thread only: {by_thread:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_runtime_serves_on_one_listener() {
    let stub = StubUpstream::start([]).await;
    let proxy = TestProxy::spawn(&config(&stub, &["threading = \"shared\"", "workers = 4"])).await;
    one_request_per_connection(&proxy).await;
    assert_eq!(
        accepted_by_thread(&proxy).await,
        vec![("shared".to_owned(), 64.0)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_connections_of_every_serving_thread() {
    const HELD: usize = 12;
    let stub = StubUpstream::start([]).await;
    let (mut arrived, release) = stub.gather();
    let mut bg = Bloomgate::serve(
        &config(
            &stub,
            &[
                "threading = \"per_core\"",
                "workers = 3",
                "shutdown_grace = \"60s\"",
            ],
        ),
        &[],
    )
    .await;
    let data = bg.data;
    let held: Vec<_> = (0..HELD)
        .map(|i| {
            tokio::spawn(async move {
                let request = format!("GET /gathered/{i} HTTP/1.1\r\nhost: x\r\n\r\n");
                send_raw(data, request.as_bytes()).await
            })
        })
        .collect();
    tokio::time::timeout(Duration::from_secs(30), arrived.wait_for(|n| *n == HELD))
        .await
        .expect("every held request reached the upstream")
        .expect("the stub counts them");

    bg.signal("TERM");
    // Each serving thread stops accepting and waits for its own connections.
    let draining = bg
        .wait_for_logs("every thread's drain", 3, Duration::from_secs(30), |l| {
            message(l) == "stopped accepting; draining" && l["fields"]["listener"] == "data"
        })
        .await;
    let waiting: u64 = draining
        .iter()
        .filter_map(|l| l["fields"]["open_connections"].as_u64())
        .sum();
    assert_eq!(waiting, HELD as u64, "{draining:#?}");
    let threads_with_connections = draining
        .iter()
        .filter(|l| l["fields"]["open_connections"].as_u64() > Some(0))
        .count();
    assert!(threads_with_connections >= 2, "{draining:#?}");
    // No listener accepts any more.
    assert!(
        tokio::net::TcpStream::connect(data).await.is_err(),
        "a new connection was accepted after the drain began"
    );
    for request in &held {
        assert!(
            !request.is_finished(),
            "a held request ended before its answer"
        );
    }

    release.send(true).expect("the stub waits");
    for request in held {
        let answer = request.await.expect("join");
        assert_eq!(raw_status(&answer), StatusCode::OK.as_u16(), "{answer}");
        // HTTP/1.1 keep-alive is ended by the server after the answer: send_raw read
        // until it closed.
    }
    assert_eq!(bg.wait_exit(Duration::from_secs(30)).await, Some(0));
}
