-- Demo catalogue for `docker compose up`: 100,000 products, loaded by MySQL's entrypoint
-- after the schema (mounted as /docker-entrypoint-initdb.d/99-seed.sql, so it sorts after
-- the migration files). It runs once, when the data volume is empty.
--
-- Keys are spread out, one present key in each block of four: product i has
-- sku_id = 4*i + 1 + (i % 3), so 1, 6, 11, ... exist and every multiple of 4
-- (4, 8, 12, ...) does not. Keys between present ones are what a penetration flood asks for.

-- A recursive CTE stops at 1000 iterations by default.
SET SESSION cte_max_recursion_depth = 100000;

INSERT INTO products (sku_id, name, price)
WITH RECURSIVE seq (i) AS (
    SELECT 0
    UNION ALL
    SELECT i + 1 FROM seq WHERE i + 1 < 100000
)
SELECT
    4 * i + 1 + (i % 3),
    CONCAT('Product ', 4 * i + 1 + (i % 3)),
    (100 + (i * 7919) % 99900) / 100
FROM seq;
