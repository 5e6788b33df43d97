//! The builder lease of one filter, held in Redis. Taking it draws a fencing epoch (an
//! `INCR`ed counter) and sets the lease to `epoch:instance` only if it is absent, with an
//! expiry, in one script. Renewal and release are compare-and-set scripts: they act only
//! while the lease still holds this holder's exact value, so an instance whose lease
//! expired and was taken by another cannot extend or delete the new holder's. Every
//! publication checks the same value in its own script (see `generation`).

use bloomgate_core::redis_conn::RedisConn;
use redis::Script;

/// A lease this instance holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The fencing epoch drawn when it was taken.
    pub epoch: u64,
    /// The lease key's value while this instance holds it: `epoch:instance`.
    pub value: String,
}

/// What an attempt to take the lease found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// This instance holds it now.
    Taken(Lease),
    /// Another holder has it (its value, `epoch:instance`).
    Held(String),
}

const ACQUIRE: &str = r"
local held = redis.call('GET', KEYS[1])
if held then
  return {0, held}
end
local epoch = redis.call('INCR', KEYS[2])
local value = epoch .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return {epoch, value}
";

const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// Tries to take the lease at `lease_key`, drawing the epoch from `fence_key`.
pub async fn acquire(
    conn: &mut RedisConn,
    lease_key: &str,
    fence_key: &str,
    instance: &str,
    ttl_ms: u64,
) -> redis::RedisResult<Attempt> {
    let (epoch, value): (u64, String) = Script::new(ACQUIRE)
        .key(lease_key)
        .key(fence_key)
        .arg(instance)
        .arg(ttl_ms)
        .invoke_async(conn)
        .await?;
    Ok(if epoch == 0 {
        Attempt::Held(value)
    } else {
        Attempt::Taken(Lease { epoch, value })
    })
}

/// Extends `lease` by `ttl_ms` if this instance still holds it; false if it does not.
pub async fn renew(
    conn: &mut RedisConn,
    lease_key: &str,
    lease: &Lease,
    ttl_ms: u64,
) -> redis::RedisResult<bool> {
    let renewed: i64 = Script::new(RENEW)
        .key(lease_key)
        .arg(&lease.value)
        .arg(ttl_ms)
        .invoke_async(conn)
        .await?;
    Ok(renewed == 1)
}

/// Gives `lease` up if this instance still holds it.
pub async fn release(
    conn: &mut RedisConn,
    lease_key: &str,
    lease: &Lease,
) -> redis::RedisResult<bool> {
    let released: i64 = Script::new(RELEASE)
        .key(lease_key)
        .arg(&lease.value)
        .invoke_async(conn)
        .await?;
    Ok(released == 1)
}

/// The instance named in a lease value (`epoch:instance`).
pub fn holder(value: &str) -> &str {
    value.split_once(':').map_or(value, |(_, who)| who)
}
