// Umbrella header for ShardTensor's C++ API.
#pragma once

#include <shardtensor/attention.h>
#include <shardtensor/comm_stats.h>
#include <shardtensor/distributed.h>
#include <shardtensor/fallback.h>
#include <shardtensor/handler_registry.h>
#include <shardtensor/memory_tracker.h>
#include <shardtensor/mesh.h>
#include <shardtensor/placement.h>
#include <shardtensor/replication.h>
#include <shardtensor/ring.h>
#include <shardtensor/shard_tensor.h>
#include <shardtensor/simulation.h>
#include <shardtensor/spec.h>
