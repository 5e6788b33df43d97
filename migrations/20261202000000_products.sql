-- The demo catalogue that `bloomgate demo` seeds and the example config gates.
-- Plain SQL valid for SQLite, MySQL 8 and MariaDB alike: sqlx applies it to all three,
-- and MySQL's docker-entrypoint-initdb.d can load it as it is.
CREATE TABLE IF NOT EXISTS products (
    sku_id     BIGINT        NOT NULL PRIMARY KEY,
    name       VARCHAR(200)  NOT NULL,
    price      DECIMAL(12,2) NOT NULL,
    updated_at TIMESTAMP     NOT NULL DEFAULT CURRENT_TIMESTAMP
);

-- Incremental sync reads `WHERE updated_at > ?`.
CREATE INDEX idx_products_updated_at ON products (updated_at);
