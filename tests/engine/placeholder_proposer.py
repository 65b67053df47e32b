"""A vLLM ``custom_class`` proposer whose drafts hold vLLM's placeholder id -1, as its scheduler
makes them (e.g. when structured output invalidates draft tokens): to check that the verifier
rejects the placeholder whatever sampler path runs. Row r drafts [-1] or [r, -1] in turn."""


class PlaceholderProposer:
    def __init__(self, vllm_config) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)

    def load_model(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        drafts = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append([])
            elif row % 2 == 0:
                drafts.append([-1][:self.k])
            else:
                drafts.append([sampled[-1], -1][:self.k])
        return drafts
