-- wrk script for the bloomgate load harness: one product key per request.
--
--   wrk ... -s benches/load/keys.lua URL -- KIND PRODUCTS HOT [ABSENT_PCT | KEY | COUNT THREADS [DONE]]
--
-- The database holds product i (0 <= i < PRODUCTS) under key 4i + 1 + (i mod 3):
-- one present slot in each block of four, so the other three slots of a block are
-- keys that never exist. KIND is one of
--   absent  every key is a random absent slot of a random block
--   hot     every key is a random member of the hot set: product h * stride,
--           h < HOT, stride = floor(PRODUCTS / HOT), spread over the whole table
--   mix     ABSENT_PCT percent absent keys, the rest from the hot set
--   walk    the hot set in order, each thread from its own starting point (warm-up)
--   fixed   always the key KEY
--   each    products 0 .. COUNT-1 once each, in order, split into THREADS contiguous
--           ranges (THREADS must equal wrk's -t); a thread stops once it has an answer
--           for every key of its range (requests still in flight then repeat the first
--           key of the range) and, given DONE, creates the file DONE<thread number>.
--           wrk itself runs for its whole -d unless sent SIGINT, which the caller can
--           do once every thread's file is there.
-- URL's path is ignored; requests go to /api/products/{key}.
-- When the run ends, one line starting with RESULT gives the totals for the harness.

local prefix = "/api/products/"
local kind, products, hot, pct, fixed_key = "absent", 3000000, 10000, 100, nil
local stride = 300
local walked = 0
local id_counter = 0
local first, last, next_i, answered, done_file = 0, 0, 0, 0, nil

local function present_key(i)
  return 4 * i + 1 + (i % 3)
end

local function absent_key(i)
  -- one of the three slots of block i other than (i mod 3)
  return 4 * i + 1 + ((i % 3) + math.random(1, 3)) % 4
end

local function hot_key(h)
  return present_key(h * stride)
end

-- Installed as response() by init() for kind "each" only: wrk reads a response's
-- headers and body into Lua only when a response() function exists.
local function each_response(status, headers, body)
  answered = answered + 1
  if answered == last - first then
    if done_file then
      io.open(done_file, "w"):close()
    end
    wrk.thread:stop()
  end
end

function setup(thread)
  id_counter = id_counter + 1
  thread:set("thread_no", id_counter)
end

function init(args)
  kind = args[1] or kind
  products = tonumber(args[2] or products)
  hot = tonumber(args[3] or hot)
  if kind == "mix" then
    pct = tonumber(args[4] or pct)
  elseif kind == "fixed" then
    fixed_key = args[4]
  end
  stride = math.floor(products / hot)
  local n = thread_no or 1 -- set by setup() in each thread's own Lua state
  if kind == "each" then
    local count, threads = tonumber(args[4]), tonumber(args[5])
    first = math.floor((n - 1) * count / threads)
    last = math.floor(n * count / threads)
    next_i = first
    if args[6] then
      done_file = args[6] .. n
    end
    response = each_response
  end
  math.randomseed(os.time() * 1000 + n * 7919)
  walked = math.floor((n - 1) * hot / 2)
end

function request()
  local key
  if kind == "absent" then
    key = absent_key(math.random(0, products - 1))
  elseif kind == "hot" then
    key = hot_key(math.random(0, hot - 1))
  elseif kind == "mix" then
    if math.random() * 100 < pct then
      key = absent_key(math.random(0, products - 1))
    else
      key = hot_key(math.random(0, hot - 1))
    end
  elseif kind == "walk" then
    key = hot_key(walked % hot)
    walked = walked + 1
  elseif kind == "each" then
    if next_i < last then
      key = present_key(next_i)
      next_i = next_i + 1
    else
      key = present_key(first)
    end
  else
    return wrk.format(nil, prefix .. fixed_key)
  end
  return wrk.format(nil, prefix .. string.format("%d", key))
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "RESULT requests=%d duration_us=%d mean_us=%.1f p99_us=%d non2xx=%d " ..
    "err_connect=%d err_read=%d err_write=%d err_timeout=%d\n",
    summary.requests, summary.duration, latency.mean, latency:percentile(99),
    e.status, e.connect, e.read, e.write, e.timeout))
end
