"""Every train_diffusion.py flag -> the test that observes its effect (or its refusal).

tests/unit/flags/test_flag_coverage.py walks the parser and fails for a flag missing here, or
whose test no longer exists. A new flag gets an entry with the test of what it does; a flag
value the trainer cannot honour is refused by the parser, and the entry names that test.
Node ids are `path::function` (a parametrized test by its function name).
"""

A = "tests/unit/flags/test_arguments.py"
R = "tests/unit/flags/test_arguments_rules.py"
B = "tests/unit/flags/test_batching.py"
V = "tests/unit/plan/test_validate_only.py"
P = "tests/unit/ray/test_placement.py"
DP = "tests/unit/ray/test_data_parallel.py"
LOOP = "tests/unit/ray/test_train_loop.py"
RESUME = "tests/unit/ray/test_resume.py"
W = "tests/unit/backends/test_flag_wiring.py"
DT = "tests/unit/backends/test_compute_dtype.py"
L = "tests/unit/backends/test_loss.py"
O = "tests/unit/backends/test_optimizer_ema.py"
M = "tests/unit/records/test_run_logging.py"
SFT = "tests/unit/backends/test_sft_train.py"
STEP = "tests/unit/rollout/test_step_strategy.py"
SAMPLER = "tests/unit/rollout/test_sampler.py"
DATA = "tests/unit/rollout/test_data.py"
SCORE = "tests/unit/rollout/rm_hub/test_score_samples.py"
POOL = "tests/unit/rollout/rm_hub/test_reward_pool.py"
MEM = "tests/unit/plan/test_memory_plan.py"
FSDP = "tests/unit/backends/test_fsdp.py"
PUBLIC = "tests/unit/flags/test_public_flags.py"
TS = "tests/unit/backends/test_train_step_flags.py"  # a real TrainRank train step, in process
ENG = "tests/unit/rollout/test_sampling_flag_effects.py"  # what an engine built from the flags samples
PATHS = "tests/unit/backends/test_algorithm_paths.py"  # the algorithms through a real TrainRank
REF = "tests/unit/backends/test_reference_losses.py"  # against restated reference formulas

VOC = "tests/unit/flags/test_flag_vocabulary.py"  # miles-diffusion's flags by one rule
CAP = "tests/unit/backends/test_capability_flags.py"
WIRE = "tests/unit/ray/test_reward_wire.py"
MAPS = f"{VOC}::test_each_mapped_name_parses_to_what_it_maps_onto"
VALUES = f"{VOC}::test_value_mapped_names_take_the_values_that_run_here"
REFUSALS = f"{VOC}::test_values_that_do_not_run_here_are_refused_in_one_line_naming_the_fix"
ALWAYS = f"{VOC}::test_names_of_what_always_happens_here_parse_unchanged_and_the_plan_says_so"

FLAG_TESTS = {
    # miles-diffusion's capability flags, the same names (miles/flags/capability_flags.py)
    "--fsdp-reduce-dtype": f"{CAP}::test_fsdp_reduce_dtype_bf16_reduces_gradients_in_bf16_and_keeps_them_in_the_param_dtype",
    "--dp-replicate-size": f"{FSDP}::test_two_sharded_ranks_and_two_hsdp_replicas_match_one_rank_keep_parity_exact_offload_and_resume_bit_exact",
    "--diffusion-sde-candidate-steps": f"{STEP}::test_epoch_global_random_choice_draws_only_the_candidate_steps",
    "--diffusion-sde-window-min-start": f"{STEP}::test_sde_window_min_start_keeps_every_window_inside_the_range_and_zero_draws_as_before",
    "--diffusion-recompute-old-log-prob": f"{CAP}::test_recomputed_old_log_probs_replace_the_engines_in_the_ppo_ratio",
    "--rollout-patch-group": REFUSALS,
    "--wandb-log-num-images": f"{M}::test_wandb_log_num_images_logs_that_many_samples_every_interval_rollouts",
    "--wandb-log-image-interval": f"{M}::test_wandb_log_num_images_logs_that_many_samples_every_interval_rollouts",
    "--pickscore-num-frames": f"{WIRE}::test_pickscore_num_frames_sets_the_frames_pickscore_is_sent_and_reads",
    # miles-diffusion's names mapped onto ours (miles/flags/upstream_values.py)
    "--diffusion-flow-shift": MAPS, "--fsdp-flow-shift": MAPS, "--ulysses-degree": MAPS, "--rollout-weights": MAPS,
    "--pickscore-reward-colocate": MAPS, "--sglang-dit-precision": MAPS, "--lr-warmup-iters": MAPS,
    "--diffusion-true-cfg-scale": VALUES, "--rollout-function-path": VALUES, "--diffusion-task": VALUES,
    "--wandb-team": VALUES, "--sft-encoder-checkpoint": VALUES,
    "--custom-convert-samples-to-train-data-path": REFUSALS, "--custom-rollout-log-function-path": REFUSALS,
    "--custom-prepare-train-batch-path": REFUSALS, "--sft-frame-stride": REFUSALS, "--diffusion-fps": REFUSALS,
    "--n-samples-per-eval-prompt": REFUSALS, "--sglang-lora-merge-mode": REFUSALS,
    "--rollout-return-full-trajectory": ALWAYS, "--disable-wandb-random-suffix": ALWAYS,
    # miles-diffusion's names (miles/flags/public_flags.py): each parses to what the flag it names parses to
    "--diffusion-forward-dtype": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--fsdp-master-dtype": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--pickscore-num-workers": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--ocr-num-workers": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--pickscore-num-gpus-per-worker": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--diffusion-reward": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--diffusion-microgroup-size": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--diffusion-negative-prompt": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--diffusion-device": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--diffusion-sde-window-size": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--diffusion-sde-window-range": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--offload": f"{PUBLIC}::test_each_public_name_parses_to_what_the_flag_it_names_parses_to",
    "--debug-train-only": f"{PUBLIC}::test_debug_train_only_is_train_only",
    # cluster
    "--actor-num-nodes": f"{R}::test_train_nodes_fit_the_job",
    "--actor-num-gpus-per-node": f"{DP}::test_two_ranks_match_one_rank_and_each_trains_its_own_shard",
    "--rollout-num-gpus": f"{P}::test_engine_count_follows_rollout_gpus_one_gpu_per_engine",
    "--rollout-num-gpus-per-engine": f"{R}::test_multi_gpu_engines_are_refused",
    "--num-gpus-per-node": f"{R}::test_train_gpus_per_node_fit_a_node",
    "--num-nodes": f"{R}::test_separate_reward_node_is_counted_with_num_nodes",
    "--colocate": f"{P}::test_colocate_shares_the_train_bundles_on_gpu_and_separates_them_without_it",
    "--sequence-parallel-size": f"{R}::test_sequence_parallel_size_other_than_1_is_refused",
    "--device": f"{POOL}::test_workers_of_a_cpu_job_ask_for_no_gpu_whatever_the_gpu_share",
    "--gpu-memory-gb": f"{MEM}::test_gpu_memory_gb_decides_the_verdict",
    "--host-memory-gb": "tests/unit/plan/test_host_plan.py::test_host_memory_gb_decides_the_verdict",
    "--train-backend": f"{FSDP}::test_two_sharded_ranks_and_two_hsdp_replicas_match_one_rank_keep_parity_exact_offload_and_resume_bit_exact",
    "--offload-train": f"{FSDP}::test_two_sharded_ranks_and_two_hsdp_replicas_match_one_rank_keep_parity_exact_offload_and_resume_bit_exact",
    "--offload-rollout": f"{FSDP}::test_two_sharded_ranks_and_two_hsdp_replicas_match_one_rank_keep_parity_exact_offload_and_resume_bit_exact",
    # batch
    "--rollout-batch-size": f"{R}::test_worked_example_of_the_design_gives_its_counts",
    "--n-samples-per-prompt": f"{R}::test_worked_example_of_the_design_gives_its_counts",
    "--global-batch-size": f"{R}::test_worked_example_of_the_design_gives_its_counts",
    "--num-steps-per-rollout": f"{R}::test_num_steps_per_rollout_derives_the_global_batch_size",
    "--micro-batch-size": f"{TS}::test_micro_batch_size_sets_the_pairs_per_backward_pass",
    "--micro-batch-size-sample": f"{R}::test_stride_split_with_2d_tiles_gives_each_rank_whole_timesteps",
    "--micro-batch-size-tstep": f"{R}::test_stride_split_with_2d_tiles_gives_each_rank_whole_timesteps",
    "--diffusion-train-iter-order": f"{B}::test_2d_tiles_visit_timesteps_first_in_timestep_major_order",
    "--train-dp-split-mode": f"{DP}::test_two_ranks_match_one_rank_and_each_trains_its_own_shard",
    # the README's command keeps a test of each flag where one observes it; the rest are observed by
    # slow tests, run nightly (docs/testing.md, "Slow tests")
    "--num-rollout": f"{LOOP}::test_rollout_only_generates_and_scores_without_training",
    "--num-epoch": f"{TS}::test_lr_decay_style_and_min_lr_shape_the_rate_over_the_whole_run",
    # sampling
    "--diffusion-num-steps": f"{W}::test_sampling_flags_reach_the_engine",
    "--diffusion-num-sde-steps": f"{STEP}::test_all_steps_are_trained_when_num_sde_steps_is_unset",
    "--diffusion-step-strategy-path": f"{STEP}::test_a_dotted_path_names_a_custom_strategy",
    "--diffusion-sde-window-max-start": f"{STEP}::test_sde_window_is_contiguous_and_starts_anywhere_up_to_the_max_start",
    "--diffusion-noise-level": f"{ENG}::test_noise_level_sets_how_far_the_sde_steps_stray_from_the_ode_step",
    "--diffusion-guidance-scale": f"{ENG}::test_guidance_scale_mixes_the_unconditional_velocity_into_every_step",
    "--diffusion-guidance-scale-2": f"{R}::test_wan22_needs_guidance_scale_2_when_the_low_noise_expert_trains",
    "--diffusion-height": f"{W}::test_sampling_flags_reach_the_engine",
    "--diffusion-width": f"{W}::test_sampling_flags_reach_the_engine",
    "--diffusion-output-num-frames": f"{W}::test_sampling_flags_reach_the_engine",
    "--diffusion-sde-type": f"{W}::test_sampling_flags_reach_the_engine",
    "--diffusion-shift": f"{R}::test_wan22_shift_moves_the_boundary",
    "--diffusion-max-sequence-length": f"{W}::test_sampling_flags_reach_the_engine",
    "--negative-prompt": f"{SAMPLER}::test_negative_prompt_steers_guided_samples_and_is_ignored_at_scale_one",
    "--rollout-microgroup-size": f"{SAMPLER}::test_microgroup_size_is_the_batch_of_every_forward",
    "--rollout-seed": f"{DATA}::test_from_args_reads_the_trainer_flags",
    "--rollout-shuffle": f"{DATA}::test_from_args_reads_the_trainer_flags",
    # model
    "--hf-checkpoint": f"{A}::test_hf_checkpoint_is_required",
    "--diffusion-model-family": f"{R}::test_family_that_cannot_be_told_from_the_checkpoint_is_refused",
    "--update-weight-target-module": "tests/unit/backends/test_lora_weight_sync.py::"
                                     "test_sync_components_default_to_every_transformer_and_reject_unknown_names",
    "--param-dtype": f"{DT}::test_bf16_compute_keeps_parity_exact_with_fp32_master_weights",
    "--compute-dtype": f"{DT}::test_bf16_compute_keeps_parity_exact_with_fp32_master_weights",  # float16: refused
    "--weight-sync": f"{LOOP}::test_skipped_optimizer_steps_keep_parity",
    "--lora-ipc-weight-sync": "tests/unit/flags/test_flag_vocabulary.py::"
                              "test_lora_ipc_weight_sync_is_ours_and_holds_a_lora_run_to_the_colocated_ipc_push",
    "--update-weight-buffer-size": f"{LOOP}::test_two_sharded_offloaded_rank_runs_keep_parity_exact_repeat_bit_for_bit_and_eval_on_their_interval",
    "--rollout-dtype": f"{DT}::test_dtype_combinations_without_exact_parity_are_refused_naming_the_fix",
    "--gradient-checkpointing": "tests/unit/backends/test_gradient_checkpointing.py::"
                                "test_gradients_are_equal_with_and_without_checkpointing",
    # algorithm
    "--loss-type": f"{SFT}::test_sft_loss_decreases_on_tiny_sd3",
    "--custom-loss-function-path": f"{L}::test_custom_loss_loads_from_both_path_forms",
    "--advantage-estimator": f"{W}::test_algorithm_flags_reach_the_loss_and_the_advantages",
    "--diffusion-clip-range": f"{TS}::test_clip_range_stops_pairs_whose_ratio_already_moved_their_way",
    "--diffusion-adv-clip-max": f"{W}::test_algorithm_flags_reach_the_loss_and_the_advantages",
    "--diffusion-kl-beta": f"{TS}::test_kl_beta_pulls_the_second_step_toward_the_reference",
    "--diffusion-kl-reference": f"{TS}::test_kl_reference_chooses_the_policy_the_kl_is_measured_against",
    "--globalize-reward-mean": f"{W}::test_algorithm_flags_reach_the_loss_and_the_advantages",
    "--globalize-reward-std": f"{W}::test_algorithm_flags_reach_the_loss_and_the_advantages",
    "--nft-beta": f"{W}::test_clip_range_and_nft_beta_change_the_loss",
    "--use-ema": f"{TS}::test_ema_is_kept_at_its_decay_and_saved_with_the_checkpoint",
    "--ema-decay": f"{TS}::test_ema_is_kept_at_its_decay_and_saved_with_the_checkpoint",
    "--diffusion-nft-adaptive-weight": f"{L}::test_nft_loss_pulls_the_positive_policy_on_good_and_the_negative_on_bad_samples",
    "--ema-rollout-policy": f"{PATHS}::test_nft_with_kl_beta_and_ema_computes_the_kl_and_samples_from_the_ramped_old_policy",
    "--ema-decay-ramp": f"{PATHS}::test_nft_with_kl_beta_and_ema_computes_the_kl_and_samples_from_the_ramped_old_policy",
    "--ema-decay-init": f"{REF}::test_old_policy_decay_equals_diffusion_nft_return_decay",
    "--ema-decay-max": f"{REF}::test_old_policy_decay_equals_diffusion_nft_return_decay",
    "--ema-decay-flat-steps": f"{REF}::test_old_policy_decay_equals_diffusion_nft_return_decay",
    "--train-uncond-branch": f"{PATHS}::test_the_unconditional_cfg_branch_is_detached_unless_asked",
    "--keep-zero-advantage-samples": f"{L}::test_zero_advantage_pairs_leave_the_policy_loss_unless_kept",
    "--lora-init-weights": "tests/unit/backends/test_lora_init.py::test_gaussian_and_kaiming_init_draw_lora_a_from_their_distributions",
    "--diffusion-timestep-fraction": f"{R}::test_trained_steps_default_to_the_reference_fraction_never_the_terminal_step",
    # optimizer
    "--lr": f"{W}::test_optimizer_flags_reach_adamw",
    "--min-lr": f"{TS}::test_lr_decay_style_and_min_lr_shape_the_rate_over_the_whole_run",
    "--lr-decay-style": f"{TS}::test_lr_decay_style_and_min_lr_shape_the_rate_over_the_whole_run",
    "--lr-warmup-steps": f"{O}::test_warmup_is_linear_then_reaches_the_peak",
    "--adam-beta1": f"{W}::test_optimizer_flags_reach_adamw",
    "--adam-beta2": f"{W}::test_optimizer_flags_reach_adamw",
    "--adam-eps": f"{W}::test_optimizer_flags_reach_adamw",
    "--weight-decay": f"{W}::test_optimizer_flags_reach_adamw",
    "--clip-grad": f"{O}::test_gradient_clipping_returns_the_norm_before_clipping",
    "--seed": "tests/unit/backends/test_sft_train.py::test_noise_and_data_position_are_functions_of_the_seed",
    # lora
    "--use-lora": f"{SFT}::test_sft_with_lora_trains_only_adapters",
    "--lora-rank": f"{R}::test_lora_defaults_follow_the_rank_and_the_family",
    "--lora-alpha": f"{TS}::test_lora_alpha_scales_what_the_trained_adapters_add",
    "--lora-target-modules": f"{R}::test_lora_defaults_follow_the_rank_and_the_family",
    # reward
    "--rm-type": f"{SCORE}::test_metadata_rm_type_overrides_the_flag_per_sample",
    "--custom-rm-path": f"{SCORE}::test_custom_reward_is_used_when_no_rm_type",
    "--reward-key": f"{SCORE}::test_reward_key_selects_from_dict_results",
    "--rm-num-workers": f"{POOL}::test_pool_matches_local_scorer_in_order_and_names_global_sample_on_error",
    "--rm-num-gpus-per-worker": f"{POOL}::test_workers_ask_for_a_quarter_cpu_and_the_configured_gpu_share",
    "--colocate-reward": f"{P}::test_gpu_colocate_puts_engines_and_colocated_rewards_in_the_train_bundles",
    "--pickscore-model-path": "tests/unit/rollout/rm_hub/test_pickscore_reward.py::"
                              "test_pickscore_without_model_path_is_a_named_error",
    "--pickscore-processor-path": "tests/unit/rollout/rm_hub/test_pickscore_reward.py::"
                                  "test_pickscore_processor_path_supplies_the_tokenizer_and_image_processor",
    "--pickscore-batch-size": "tests/unit/rollout/rm_hub/test_pickscore_reward.py::"
                              "test_pickscore_batch_size_sets_pairs_per_forward_and_leaves_the_scores",
    "--reward-timeout": f"{SCORE}::test_timeout_names_the_reward",
    # data
    "--prompt-data": f"{DATA}::test_from_args_reads_the_trainer_flags",
    "--input-key": f"{DATA}::test_reads_prompts_and_metadata_with_custom_keys",
    "--metadata-key": f"{DATA}::test_reads_prompts_and_metadata_with_custom_keys",
    # eval
    "--eval-interval": f"{LOOP}::test_two_sharded_offloaded_rank_runs_keep_parity_exact_repeat_bit_for_bit_and_eval_on_their_interval",
    "--eval-prompt-data": f"{LOOP}::test_two_sharded_offloaded_rank_runs_keep_parity_exact_repeat_bit_for_bit_and_eval_on_their_interval",
    "--eval-num-prompts": f"{LOOP}::test_two_sharded_offloaded_rank_runs_keep_parity_exact_repeat_bit_for_bit_and_eval_on_their_interval",
    "--diffusion-eval-num-steps": f"{LOOP}::test_two_sharded_offloaded_rank_runs_keep_parity_exact_repeat_bit_for_bit_and_eval_on_their_interval",
    "--skip-eval-before-train": f"{LOOP}::test_skipped_optimizer_steps_keep_parity",
    # checkpoint
    "--save": f"{RESUME}::test_killed_run_resumes_at_the_next_rollout_and_ends_like_an_uninterrupted_one",
    "--save-interval": f"{RESUME}::test_killed_run_resumes_at_the_next_rollout_and_ends_like_an_uninterrupted_one",
    "--load": f"{RESUME}::test_killed_run_resumes_at_the_next_rollout_and_ends_like_an_uninterrupted_one",
    "--start-rollout-id": f"{M}::test_a_resumed_logger_drops_rows_from_the_start_id_on",
    "--load-anyway": "tests/unit/records/test_checkpoint_identity.py::test_a_load_with_other_training_flags_names_each_one_unless_load_anyway",
    "--keep-last": "tests/unit/backends/test_checkpoint.py::test_keep_last_2_over_5_saves_leaves_exactly_the_last_2_and_latest",
    "--keep-every": "tests/unit/backends/test_checkpoint.py::test_keep_every_kth_is_kept_beside_the_last_n",
    # debug
    "--diffusion-debug-mode": f"{LOOP}::test_stop_on_parity_drift_ends_the_run_at_the_first_off_policy_rollout_naming_the_stale_tensors",
    "--diffusion-debug-probe-micro-batches": "tests/unit/backends/test_probe_sampling.py::"
                                             "test_sampling_one_micro_batch_saves_the_other_probe_forwards_and_changes_no_metric",
    "--stop-on-parity-drift": f"{LOOP}::test_stop_on_parity_drift_ends_the_run_at_the_first_off_policy_rollout_naming_the_stale_tensors",
    "--debug-skip-optimizer-step": f"{LOOP}::test_skipped_optimizer_steps_keep_parity",
    "--debug-rollout-only": f"{LOOP}::test_rollout_only_generates_and_scores_without_training",
    "--train-only": f"{R}::test_train_only_runs_no_rollout_engines",
    "--debug-skip-weight-update-at": f"{LOOP}::test_stop_on_parity_drift_ends_the_run_at_the_first_off_policy_rollout_naming_the_stale_tensors",
    "--debug-fault": "tests/e2e/test_faults.py::test_nan_loss_stops_the_run_before_the_update_is_saved_and_is_not_restarted",
    "--remote-timeout-s": "tests/unit/ray/test_fault_classification.py::test_remote_deadlines_start_at_the_first_timeout_then_scale_with_the_slowest_call",
    "--remote-timeout-factor": "tests/unit/ray/test_fault_classification.py::test_remote_deadlines_start_at_the_first_timeout_then_scale_with_the_slowest_call",
    "--remote-timeout-min-s": "tests/e2e/test_faults.py::test_hung_reward_worker_ends_at_its_deadline_and_the_printed_command_resumes_exactly",
    "--placement-timeout-s": "tests/unit/ray/test_startup_failures.py::test_placement_timeout_s_ends_the_drivers_wait_for_a_busy_cluster",
    # determinism
    "--deterministic-mode": f"{LOOP}::test_two_sharded_offloaded_rank_runs_keep_parity_exact_repeat_bit_for_bit_and_eval_on_their_interval",
    # logging
    "--run-dir": f"{R}::test_run_dir_defaults_to_a_timestamped_dir_under_runs",
    "--use-wandb": f"{M}::test_wandb_offline_mirrors_the_metrics",
    "--wandb-project": f"{M}::test_wandb_offline_mirrors_the_metrics",
    "--wandb-group": f"{M}::test_wandb_offline_mirrors_the_metrics",
    "--wandb-run-name": f"{M}::test_wandb_offline_mirrors_the_metrics",
    "--wandb-mode": f"{M}::test_wandb_offline_mirrors_the_metrics",
    "--wandb-dir": f"{M}::test_wandb_offline_mirrors_the_metrics",
    "--wandb-required": "tests/unit/records/test_wandb_conventions.py::"
                        "test_a_wandb_that_cannot_start_is_one_warning_and_the_run_goes_on",
    # config
    "--custom-config-path": f"{A}::test_config_file_overrides_the_command_line_key_by_key",
    "--validate-only": f"{V}::test_main_returns_0_after_validate_only",
}
