-- What bloomgate's binlog mode needs of its user (docs/freshness.md, "Binlog mode"):
-- to register as a replica and read the binary log. Loaded by MySQL's entrypoint after
-- it has created MYSQL_USER (mounted as /docker-entrypoint-initdb.d/10-replication.sql).
-- The user already has every privilege on the shop database, SELECT included.
GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO 'bloomgate'@'%';
