//! The change stream: one Redis Stream per namespace that every instance appends its
//! local changes to and reads in full from its own position (no consumer group: each
//! instance must see every entry). Reading blocks on a connection of its own, so a
//! blocked read never delays a lease renewal on the command connection.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use bloomgate_core::redis_conn::RedisConn;
use redis::Value;
use redis::streams::{StreamRangeReply, StreamReadReply};
use tokio::sync::mpsc;

use super::Fleet;
use super::change::{self, Change, Entry};
use bloomgate_core::key::OwnedKey;

/// A position in a Redis Stream: the entry ID `ms-seq`. `0-0` is before every entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamPos {
    /// Milliseconds part.
    pub ms: u64,
    /// Sequence part.
    pub seq: u64,
}

impl fmt::Display for StreamPos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

impl FromStr for StreamPos {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        let (ms, seq) = s.split_once('-').ok_or(())?;
        Ok(StreamPos {
            ms: ms.parse().map_err(|_| ())?,
            seq: seq.parse().map_err(|_| ())?,
        })
    }
}

/// Entries read per round trip.
const READ_COUNT: usize = 500;
/// Changes kept while Redis cannot take them; past this the oldest are dropped, counted.
pub const OUTBOX_LIMIT: usize = 100_000;
/// Changes appended per round trip.
const APPEND_BATCH: usize = 100;

/// Reads the stream from this instance's position and applies every entry, until aborted.
pub async fn read_loop(fleet: Arc<Fleet>, mut conn: RedisConn) {
    let key = fleet.keys.stream();
    let block_ms = 1000u64;
    loop {
        let from = fleet.position();
        let read: redis::RedisResult<Option<StreamReadReply>> = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(READ_COUNT)
            .arg("BLOCK")
            .arg(block_ms)
            .arg("STREAMS")
            .arg(&key)
            .arg(from.to_string())
            .query_async(&mut conn)
            .await;
        match read {
            Ok(Some(reply)) => {
                for ids in reply.keys {
                    for entry in ids.ids {
                        let Ok(at) = entry.id.parse::<StreamPos>() else {
                            continue;
                        };
                        fleet.apply_entry(at, &entry.map).await;
                        fleet.advance_position(from, at);
                    }
                }
            }
            Ok(None) => {}
            Err(e) => {
                fleet.redis_failed("stream read", &e);
                tokio::time::sleep(fleet.config.retry_interval).await;
            }
        }
    }
}

/// The admitted keys of `filter` in entries after `after`, in stream order, with their
/// positions; for a generation swapped in on top of which they are replayed.
pub async fn admitted_since(
    fleet: &Fleet,
    conn: &mut RedisConn,
    filter: &str,
    after: StreamPos,
) -> redis::RedisResult<Vec<(StreamPos, OwnedKey)>> {
    let key = fleet.keys.stream();
    let mut from = after;
    let mut out = Vec::new();
    loop {
        let reply: StreamRangeReply = redis::cmd("XRANGE")
            .arg(&key)
            .arg(format!("({from}"))
            .arg("+")
            .arg("COUNT")
            .arg(10_000)
            .query_async(conn)
            .await?;
        let n = reply.ids.len();
        for entry in reply.ids {
            let Ok(at) = entry.id.parse::<StreamPos>() else {
                continue;
            };
            from = at;
            if let Ok((
                Entry::Change(Change::Admit {
                    filter: f, keys, ..
                }),
                _,
            )) = fleet.decode(&entry.map)
                && &*f == filter
            {
                out.extend(keys.into_iter().map(|k| (at, k)));
            }
        }
        if n < 10_000 {
            return Ok(out);
        }
    }
}

/// Appends local changes to the stream, in order, until the outbox closes. While Redis
/// is unreachable they wait here (up to [`OUTBOX_LIMIT`]) and go out when it is back.
pub async fn append_loop(fleet: Arc<Fleet>, mut outbox: mpsc::Receiver<Change>) {
    let key = fleet.keys.stream();
    let mut pending: VecDeque<Change> = VecDeque::new();
    loop {
        if pending.is_empty() {
            match outbox.recv().await {
                Some(c) => pending.push_back(c),
                None => return,
            }
        }
        while let Ok(c) = outbox.try_recv() {
            pending.push_back(c);
        }
        if pending.len() > OUTBOX_LIMIT {
            let over = pending.len() - OUTBOX_LIMIT;
            pending.drain(..over);
            fleet.metrics.entries("dropped", over as u64);
            tracing::error!(
                dropped = over,
                "fleet outbox overflowed while Redis was unreachable; the oldest changes were not sent"
            );
        }
        let batch = pending.len().min(APPEND_BATCH);
        let mut pipe = redis::pipe();
        for c in pending.iter().take(batch) {
            let cmd = pipe.cmd("XADD").arg(&key).arg("*");
            for (field, value) in c.fields(&fleet.instance) {
                cmd.arg(field).arg(value);
            }
            cmd.ignore();
        }
        let mut conn = fleet.conn.clone();
        match pipe.query_async::<()>(&mut conn).await {
            Ok(()) => {
                pending.drain(..batch);
                fleet.metrics.entries("appended", batch as u64);
            }
            Err(e) => {
                fleet.redis_failed("stream append", &e);
                // Keep taking changes while waiting, so the senders never block.
                let wait = tokio::time::sleep(fleet.config.retry_interval);
                tokio::pin!(wait);
                loop {
                    tokio::select! {
                        _ = &mut wait => break,
                        c = outbox.recv() => match c {
                            Some(c) => pending.push_back(c),
                            None => break,
                        },
                    }
                }
            }
        }
    }
}

/// The last entry's position, `None` for an empty or absent stream.
pub async fn last_position(
    conn: &mut RedisConn,
    key: &str,
) -> redis::RedisResult<Option<StreamPos>> {
    let reply: StreamRangeReply = redis::cmd("XREVRANGE")
        .arg(key)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(conn)
        .await?;
    Ok(reply.ids.first().and_then(|e| e.id.parse().ok()))
}

/// How many entries follow `after` (counting at most `cap`), and the first one's position.
pub async fn behind(
    conn: &mut RedisConn,
    key: &str,
    after: StreamPos,
    cap: usize,
) -> redis::RedisResult<(usize, Option<StreamPos>)> {
    let reply: StreamRangeReply = redis::cmd("XRANGE")
        .arg(key)
        .arg(format!("({after}"))
        .arg("+")
        .arg("COUNT")
        .arg(cap)
        .query_async(conn)
        .await?;
    Ok((
        reply.ids.len(),
        reply.ids.first().and_then(|e| e.id.parse().ok()),
    ))
}

/// The highest position trimmed away from the stream (`max-deleted-entry-id` of
/// `XINFO STREAM`); `None` when the stream does not exist.
pub async fn max_deleted(conn: &mut RedisConn, key: &str) -> redis::RedisResult<Option<StreamPos>> {
    let exists: bool = redis::cmd("EXISTS").arg(key).query_async(conn).await?;
    if !exists {
        return Ok(None);
    }
    let info: Value = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(key)
        .query_async(conn)
        .await?;
    let pairs: Vec<(String, Value)> = match info {
        Value::Map(m) => m
            .into_iter()
            .filter_map(|(k, v)| redis::from_redis_value::<String>(k).ok().map(|k| (k, v)))
            .collect(),
        Value::Array(items) => items
            .chunks(2)
            .filter_map(|kv| match kv {
                [k, v] => redis::from_redis_value::<String>(k.clone())
                    .ok()
                    .map(|k| (k, v.clone())),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    Ok(pairs
        .into_iter()
        .find(|(k, _)| k == "max-deleted-entry-id")
        .and_then(|(_, v)| redis::from_redis_value::<String>(v).ok())
        .and_then(|s| s.parse().ok()))
}

/// Stream fields of one entry, as the reply gave them.
pub type Fields = HashMap<String, Value>;

impl Fleet {
    /// Decodes an entry against this instance's filters.
    pub fn decode(&self, fields: &Fields) -> Result<(Entry, Option<String>), change::EntryError> {
        change::decode(fields, |name| {
            self.members
                .get(name)
                .map(|m| (Arc::clone(&m.name), m.filter.normalize_rule().clone()))
        })
    }
}
