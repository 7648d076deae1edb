"""The far tier: pages shared by a fleet of servers through a Valkey/Redis Cluster.

Each host's server is a near cache (DRAM, then disk); the far tier below it is an
existing cluster whose sharding, replication and failover are the cluster's, not ours
(docs/far.md says why, and what it promises). A page's life there:

    put on host A --(--far-write through: on commit; evict: when it leaves A)-->
      WriteBehind.offer (bounded queue, drops when full) --> thread --> FarClient.put
      (SET, value = codec header signed with the fleet's secret + page, one pipelined
      batch per layout)
    lookup on host B, missed locally --> FarClient.exists (one EVAL_RO per bucket,
      one round trip per shard, deadline --far-timeout) --> hit or miss
    get on host B --> FarClient.read (one EVAL_RO per bucket, a value no longer than
      its page) --> codec.decode: served only if magic, version, layout, key, length and
      MAC all match; else a counted miss
    expiry: --far-ttl, or the cluster's own maxmemory eviction

Modules, one idea each: settings (the --far* flags), keys (Redis key names and hash
tags), codec (the value header and its MAC), secret (the fleet's keys), client (pipelined calls with a deadline, errors as
misses), writer (write-behind queue and thread), breaker (stop asking a dead cluster),
metrics (kvstore_far_*).
"""
