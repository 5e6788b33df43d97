-- The demo catalogue that `bloomgate demo` seeds and the example config gates.
-- Plain SQL valid for SQLite, MySQL 8 and MariaDB alike. Apply it once per database,
-- either through sqlx (Db::migrate, which records it in _sqlx_migrations) or by loading
-- the file (MySQL's docker-entrypoint-initdb.d), not both: MySQL has no
-- CREATE INDEX IF NOT EXISTS, so a second run stops at the index.
CREATE TABLE IF NOT EXISTS products (
    sku_id     BIGINT        NOT NULL PRIMARY KEY,
    name       VARCHAR(200)  NOT NULL,
    price      DECIMAL(12,2) NOT NULL,
    updated_at TIMESTAMP     NOT NULL DEFAULT CURRENT_TIMESTAMP
);

-- Incremental sync reads the rows changed since its last pass by updated_at.
CREATE INDEX idx_products_updated_at ON products (updated_at);
