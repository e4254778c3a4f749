"""WanWorld: diffusers' `WanTransformer3DModel` trained here as a camera-conditioned world model.

TinyWorld's keys are mostly a per-slot constant (a learned position embedding dominates them);
real video DiTs add position only through 3D RoPE, so their pre-rotary keys carry content.
WanWorld is a small Wan trained on the same renderer and trajectories, rolled out through the
same `wan_diffusers` adapter a real checkpoint takes. Its pieces, one concept per file:

- `latents.py`: the fixed encoding of 32x32 RGB frames into 12 x 16 x 16 latents (no VAE);
- `camera.py`: the small module that turns a chunk's pose and action into the cross-attention
  tokens (`encoder_hidden_states`) Wan reads in place of a text embedding;
- `model.py`: the architecture (transformer config + camera module) and the adapter's hooks;
- `weights.py`: the weights file (safetensors + JSON metadata) and loading it as an adapter;
- `teacher.py`: one diffusers forward over a whole clip with the cache's block-causal mask
  (teacher forcing), which the cached rollout equals;
- `train.py` / `train_config.py`: the resumable, seeded training task.
"""
