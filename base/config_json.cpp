// The configuration's one JSON form, made from the typed fields (config.h's config_json): what show-config prints,
// what a checkpoint records and what a resumed run is compared with.
#include <optional>
#include <string>

#include "base/config.h"
#include "base/lora.h"

namespace trainer {

namespace {

template <typename T>
Json or_null(const std::optional<T>& v) {
    return v ? Json(*v) : Json(nullptr);
}
// A choice whose "null" spelling is JSON null (the wrapping and checkpointing policies).
template <typename E>
Json choice_or_null(E value, E null_value) {
    return value == null_value ? Json(nullptr) : Json(choice_name(value));
}

Json model_json(const ModelConfig& m) {
    return {{"d_model", m.d_model},
            {"n_heads", m.n_heads},
            {"n_kv_heads", m.n_kv_heads},
            {"n_layers", m.n_layers},
            {"mlp_ratio", m.mlp_ratio},
            {"mlp_hidden_size", or_null(m.mlp_hidden_size)},
            {"activation_type", choice_name(m.activation_type)},
            {"rope", m.rope},
            {"rope_theta", m.rope_theta},
            {"layer_norm_type", choice_name(m.layer_norm_type)},
            {"layer_norm_with_affine", m.layer_norm_with_affine},
            {"include_bias", m.include_bias},
            {"bias_for_layer_norm", m.bias_for_layer_norm},
            {"layer_norm_eps", m.layer_norm_eps},
            {"attention_layer_norm", m.attention_layer_norm},
            {"attention_layer_norm_with_affine", m.attention_layer_norm_with_affine},
            {"norm_after", m.norm_after},
            {"weight_tying", m.weight_tying},
            {"vocab_size", m.vocab_size},
            {"embedding_size", m.embedding_size},
            {"max_sequence_length", m.max_sequence_length},
            {"init_fn", choice_name(m.init_fn)},
            {"init_std", m.init_std},
            {"init_cutoff_factor", or_null(m.init_cutoff_factor)},
            {"eos_token_id", m.eos_token_id},
            {"pad_token_id", m.pad_token_id}};
}

Json data_json(const DataConfig& d) {
    Json sources = Json::array();
    for (const DataSource& s : d.sources) {
        sources.push_back({{"source_name", s.name},
                           {"paths", s.paths},
                           {"label_mask_paths", s.label_mask_paths.empty() ? Json(nullptr) : Json(s.label_mask_paths)},
                           {"target_ratio", s.target_ratio},
                           {"max_repetition_ratio", s.max_repetition_ratio}});
    }
    const InstanceFilter filter = d.instance_filter.value_or(InstanceFilter{});
    return {{"paths", d.sources.empty() ? Json(d.paths) : Json(nullptr)},
            {"label_mask_paths", d.label_mask_paths.empty() ? Json(nullptr) : Json(d.label_mask_paths)},
            {"sources", sources},
            {"memmap_dtype", choice_name(d.memmap_dtype)},
            {"shuffle", d.shuffle},
            {"seed", d.seed},
            {"instance_filter",
             {{"repetition_max_period", d.instance_filter ? Json(filter.max_period) : Json(nullptr)},
              {"repetition_max_count", d.instance_filter ? Json(filter.max_count) : Json(nullptr)},
              {"repetition_min_period", filter.min_period}}}};
}

}  // namespace

Json config_json(const TrainConfig& c) {
    const SchedulerConfig& s = c.scheduler;
    Json evaluators = Json::array();
    for (const EvaluatorConfig& e : c.evaluators) {
        evaluators.push_back(
            {{"label", e.label},
             {"type", choice_name(e.type)},
             {"data",
              {{"paths", e.paths},
               {"label_mask_paths", e.label_mask_paths.empty() ? Json(nullptr) : Json(e.label_mask_paths)},
               {"memmap_dtype", choice_name(e.memmap_dtype)}}},
             {"subset_num_batches", e.subset_num_batches}});
    }
    const Json z_loss_default = config_key_default("auxiliary_loss_multiplier");
    Json doc = {
        {"run_name", c.run_name},
        {"seed", c.seed},
        {"model", model_json(c.model)},
        {"optimizer",
         {{"name", c.optimizer.name},
          {"learning_rate", c.optimizer.learning_rate},
          {"betas", {c.optimizer.beta1, c.optimizer.beta2}},
          {"eps", c.optimizer.eps},
          {"weight_decay", c.optimizer.weight_decay},
          {"decay_norm_and_bias", c.optimizer.decay_norm_and_bias},
          {"decay_embeddings", c.optimizer.decay_embeddings}}},
        {"scheduler",
         {{"name", choice_name(s.name)},
          {"t_warmup", s.t_warmup},
          {"t_max", or_null(s.t_max)},
          {"alpha_f", s.alpha_f},
          {"warmup_min_lr", or_null(s.warmup_min_lr)},
          {"grad_clip_warmup_steps", or_null(s.grad_clip_warmup_steps)},
          {"grad_clip_warmup_factor", or_null(s.grad_clip_warmup_factor)},
          {"t_decay", or_null(s.t_decay)},
          {"decay_fraction", or_null(s.decay_fraction)},
          {"decay_shape", s.decay_shape ? Json(choice_name(*s.decay_shape)) : Json(nullptr)}}},
        {"max_grad_norm", or_null(c.max_grad_norm)},
        {"softmax_auxiliary_loss", c.z_loss_multiplier > 0.0},
        {"auxiliary_loss_multiplier", c.z_loss_multiplier > 0.0 ? Json(c.z_loss_multiplier) : z_loss_default},
        {"global_train_batch_size", c.global_train_batch_size},
        {"device_train_microbatch_size", c.device_train_microbatch_size},
        {"device_eval_batch_size", c.device_eval_batch_size},
        {"max_duration", c.max_duration.unit == Duration::Unit::kSteps
                             ? Json(static_cast<long long>(c.max_duration.value))
                             : Json(c.max_duration.text)},
        {"data", data_json(c.data)},
        {"evaluators", evaluators},
        {"eval_interval", c.eval_interval},
        {"eval_on_startup", c.eval_on_startup},
        {"tokenizer", {{"identifier", c.tokenizer.identifier}}},
        {"sample",
         {{"interval", c.sample.interval},
          {"prompt", c.sample.prompt},
          {"tokenizer", c.sample.tokenizer ? Json(choice_name(*c.sample.tokenizer)) : Json(nullptr)},
          {"max_new_tokens", c.sample.max_new_tokens},
          {"top_k", c.sample.top_k},
          {"temperature", c.sample.temperature}}},
        {"save_folder", or_null(c.save_folder)},
        {"save_interval", c.save_interval},
        {"save_overwrite", c.save_overwrite},
        {"save_num_checkpoints_to_keep", c.save_num_checkpoints_to_keep},
        {"save_safetensors", c.save_safetensors},
        {"save_async", c.save_async},
        {"load_path", or_null(c.load_path)},
        {"try_load_latest_save", c.try_load_latest_save},
        {"init_from", or_null(c.init_from)},
        {"metrics_file", or_null(c.metrics_file)},
        {"tensorboard_dir", or_null(c.tensorboard_dir)},
        {"console_log_interval", c.console_log_interval},
        {"utilization_interval", c.utilization_interval},
        {"straggler_factor", c.straggler_factor},
        {"trace_file", or_null(c.trace_file)},
        {"device", choice_name(c.device)},
        {"precision", choice_name(c.precision)},
        {"kernels",
         {{"attention", choice_name(c.kernels_attention)},
          {"bf16_activations", c.kernels_bf16_activations},
          {"cuda_graphs", c.kernels_cuda_graphs},
          {"classifier_one_read", c.kernels_classifier_one_read}}},
        {"distributed_backend", choice_name(c.distributed_backend)},
        {"distributed_strategy", choice_name(c.distributed_strategy)},
        {"fsdp",
         {{"sharding_strategy", choice_name(c.fsdp.sharding_strategy)},
          {"wrapping_strategy", choice_or_null(c.fsdp.wrapping_strategy, WrappingStrategy::kNull)},
          {"block_group_size", c.fsdp.block_group_size},
          {"precision", choice_name(c.fsdp.precision)},
          {"grad_sync_mode", choice_name(c.fsdp.grad_sync_mode)},
          {"min_num_params", c.fsdp.min_num_params},
          {"hybrid_sharding_num_model_replicas", or_null(c.fsdp.hybrid_sharding_num_model_replicas)},
          {"forward_prefetch", c.fsdp.forward_prefetch},
          {"backward_prefetch", c.fsdp.backward_prefetch},
          {"limit_all_gathers", c.fsdp.limit_all_gathers}}},
        {"ddp", {{"grad_sync_mode", choice_name(c.ddp_grad_sync_mode)}}},
        {"cpu_offload", {{"optimizer_state", c.cpu_offload.optimizer_state}, {"parameters", c.cpu_offload.parameters}}},
        {"lora",
         {{"enabled", c.lora.enabled},
          {"r", c.lora.r},
          {"alpha", c.lora.alpha},
          {"dropout", c.lora.dropout},
          {"use_rslora", c.lora.use_rslora},
          {"targets", c.lora.targets.empty() ? Json(nullptr) : Json(c.lora.targets)},
          {"init_from", or_null(c.lora.init_from)},
          {"quantize", c.lora.nf4 ? "nf4" : "none"},
          {"double_quant", c.lora.double_quant}}},
        {"activation_checkpointing", choice_or_null(c.activation_checkpointing, ActivationCheckpointing::kNull)},
        {"peak_flops_per_device", or_null(c.peak_flops_per_device)},
        {"threads", c.threads},
        {"distributed_timeout_seconds", c.distributed_timeout_seconds},
        {"plan",
         {{"hardware", or_null(c.plan.hardware)},
          {"calibration", or_null(c.plan.calibration)},
          {"comm_calibration", or_null(c.plan.comm_calibration)},
          {"device_memory_gib", or_null(c.plan.device_memory_gib)},
          {"host_memory_gib", or_null(c.plan.host_memory_gib)}}}};
    return doc;
}

}  // namespace trainer
