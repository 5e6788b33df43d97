#!/usr/bin/env python3
"""Ask a bloomgate filter held in Redis whether keys may exist, without bloomgate.

    python3 examples/redis_gate_client.py REDIS_URL NAMESPACE FILTER KEY...

prints one line per key: "KEY maybe" (the key may exist) or "KEY absent" (it certainly
does not). Needs redis-py (`pip install redis`). The hash scheme, the key layout and
the script are described in docs/redis-gate.md; this file is the reference client the
tests run against a real Redis, so it must give bloomgate's answers bit for bit.

A key is hashed as bloomgate hashes it: its canonical bytes (an integer key in plain
decimal, a text key after trimming and the filter's lowercasing), not the raw request.
"""

import sys

import redis

MASK = (1 << 64) - 1

# The check script, as bloomgate runs it (src/gate/redis_held.rs, CHECK_SCRIPT).
CHECK = """
local block = redis.call('GETRANGE', KEYS[1], ARGV[1], ARGV[1] + 63)
if #block < 64 then
  return -1
end
for i = 2, #ARGV do
  local p = tonumber(ARGV[i])
  local byte = string.byte(block, math.floor(p / 8) + 1)
  if bit.band(byte, bit.lshift(1, p % 8)) == 0 then
    return 0
  end
end
return 1
"""


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & MASK


def _fmix(k):
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & MASK
    return k ^ (k >> 33)


def murmur3_x64_128(data, seed):
    """The reference MurmurHash3 x64 128-bit, as (h1, h2), the low and high halves."""
    c1, c2 = 0x87C37B91114253D5, 0x4CF5AD432745937F
    h1 = h2 = seed
    full = len(data) // 16 * 16
    for i in range(0, full, 16):
        k1 = int.from_bytes(data[i:i + 8], "little")
        k2 = int.from_bytes(data[i + 8:i + 16], "little")
        h1 ^= _rotl((k1 * c1) & MASK, 31) * c2 & MASK
        h1 = (_rotl(h1, 27) + h2) & MASK
        h1 = (h1 * 5 + 0x52DCE729) & MASK
        h2 ^= _rotl((k2 * c2) & MASK, 33) * c1 & MASK
        h2 = (_rotl(h2, 31) + h1) & MASK
        h2 = (h2 * 5 + 0x38495AB5) & MASK
    tail = data[full:]
    if len(tail) > 8:
        k2 = int.from_bytes(tail[8:], "little")
        h2 ^= _rotl((k2 * c2) & MASK, 33) * c1 & MASK
    if tail:
        k1 = int.from_bytes(tail[:8], "little")
        h1 ^= _rotl((k1 * c1) & MASK, 31) * c2 & MASK
    h1 ^= len(data)
    h2 ^= len(data)
    h1 = (h1 + h2) & MASK
    h2 = (h2 + h1) & MASK
    h1, h2 = _fmix(h1), _fmix(h2)
    h1 = (h1 + h2) & MASK
    h2 = (h2 + h1) & MASK
    return h1, h2


def _mix64(x):
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def locate(key, seed, blocks, hashes):
    """The key's block and its in-block bit positions (each 0..511)."""
    h1, h2 = murmur3_x64_128(key, seed)
    block = (h1 * blocks) >> 64
    positions = []
    word = rest = h2
    left_in_word = 7
    for _ in range(hashes):
        if left_in_word == 0:
            word = _mix64(word)
            rest = word
            left_in_word = 7
        left_in_word -= 1
        positions.append(rest % 512)
        rest >>= 9
    return block, positions


class Gate:
    """One filter held in Redis by bloomgate."""

    def __init__(self, client, namespace, name):
        self.client = client
        self.prefix = f"{{{namespace}}}:gate:{name}:"
        self.shard_tag = f"{namespace}:gate:{name}:"
        self.check = client.register_script(CHECK)

    def layout(self):
        """The current generation's record, with its numbers as ints."""
        record = self.client.hgetall(self.prefix + "current")
        if not record:
            raise LookupError("no generation of this filter is in Redis")
        return {k.decode(): int(v) for k, v in record.items()}

    def may_contain(self, key, layout=None):
        """True if the key may exist, False if it certainly does not."""
        layout = layout or self.layout()
        blocks = layout["bits"] // 512
        block, positions = locate(key, layout["seed"], blocks, layout["hashes"])
        shard, index = divmod(block, layout["shard_blocks"])
        name = f"{{{self.shard_tag}{shard}}}:gen:{layout['gen']}"
        answer = self.check(keys=[name], args=[index * 64] + positions)
        if answer < 0:
            raise LookupError(f"shard {shard} of generation {layout['gen']} is missing")
        return answer == 1


def main(argv):
    if len(argv) < 5:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    url, namespace, name, keys = argv[1], argv[2], argv[3], argv[4:]
    gate = Gate(redis.Redis.from_url(url), namespace, name)
    layout = gate.layout()
    for key in keys:
        verdict = "maybe" if gate.may_contain(key.encode(), layout) else "absent"
        print(f"{key} {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
