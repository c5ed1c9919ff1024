"""The data pipeline: what the model is trained on, token by token.

    tokenizer.build_tokenizer(template)         char-level tokenizer + chat template
    render.Renderer(tokenizer).render(msgs)     ids + per-token role + is_sampled
    render.renderer_for(template, path, choice) the renderer a recipe section uses
    render.Renderer.render_training(msgs)       SFT sequences: each turn as the newest
    render.Renderer.parse_turn / next_turn      RL: a generated turn read back; the next
                                                turn's tokens, token-in, token-out
    templates.family.FamilyTemplate             labels from a `renderers` model family
    templates.model_template.ModelTemplate      labels from a model's own chat template
    mask.token_mask(seq, policy)                sampled | all | roles table
    trajectory.TrajectoryBuilder                RL: prompt + sampled + inserted segments
    trajectory.expert_rollout                   the rollout loop with a scripted expert
    packing.pack(seqs, policy, length)          -> PackedBatch (the one next-token shift)
    sft.load_conversations / sft.PackedSft      a recipe's data: section end to end
    sft.training_sequences(convs, i, renderer)  one SFT row's sequences, its tools printed
    tasks.get_task / tasks.task_for             built-in RL tasks, dataset tasks
    rewards.load_reward / rewards.call_reward   built-in and user rewards, one convention
    environment.EnvStep / Environment           what answers the model between its turns
    references.load_reference(ref)              `package.module:Name` / `file.py:Name`
    prompts.PromptDataset                       dataset rows -> prompts (split, epochs)
    prompts.ConversationDataset                 dataset rows -> SFT conversations
    dataset_files.open_table                    dataset files as memory-mapped Arrow

Modules are imported one by one (this package imports nothing) so that importing
`mtprun.data.batch` stays cheap.
"""
