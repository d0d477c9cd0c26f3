-- Connection ids when several nodes share this database (ARCHITECTURE §7): one
-- sequence orders every connection of the cluster, so "the newer connection of a
-- device" means the same thing on every node. A single node counts in memory.
CREATE SEQUENCE conn_ids;
