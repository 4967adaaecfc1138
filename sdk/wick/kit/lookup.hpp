#pragma once
/// \file lookup.hpp
/// An embedding lookup whose table may live in host memory while the ids are
/// on a device (wick::HostLookups, wick.train's offload_embeddings): the
/// lookup runs where the table is and only the looked-up rows travel, so the
/// device holds [batch, tokens, hidden] instead of [vocabulary, hidden].
/// \code
///   at::Tensor x = wick::lookup(embed_tokens->weight, input_ids, padding_idx);
/// \endcode

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace wick {

/// at::embedding(table, ids, padding_idx, false, sparse) on ids' device. With
/// the table elsewhere (host memory), the ids go to it, the rows are gathered
/// there (into pinned memory when the ids are on a GPU) and copied to the ids'
/// device on its current stream without waiting for the copy. A table that
/// takes a gradient there keeps its graph (the copy is differentiable).
inline at::Tensor lookup(const at::Tensor& table, const at::Tensor& ids, std::int64_t padding_idx = -1,
                         bool sparse = false) {
  if (table.device() == ids.device()) return at::embedding(table, ids, padding_idx, false, sparse);
  const at::Tensor where = ids.to(table.device());
  if (table.requires_grad() || !ids.is_cuda() || !table.is_cpu())
    return at::embedding(table, where, padding_idx, false, sparse).to(ids.device());
  auto shape = where.sizes().vec();
  shape.push_back(table.size(1));
  at::Tensor rows = at::empty({where.numel(), table.size(1)}, table.options().pinned_memory(true));
  at::index_select_out(rows, table, 0, where.reshape({-1}));
  return rows.view(shape).to(ids.device(), /*non_blocking=*/true);
}

}  // namespace wick
