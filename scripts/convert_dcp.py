"""Merge a checkpoint's DCP weight shards into model.safetensors (offline, one process, no GPU).

    python scripts/convert_dcp.py checkpoint_dir=outputs/train/run/checkpoints/005000
    python scripts/convert_dcp.py --checkpoint_dir=outputs/train/run/checkpoints/last --delete_dcp=true
    python scripts/convert_dcp.py checkpoint_dir=... delete_dcp=true push_to_hub=${HF_USER}/my_policy
    python scripts/convert_dcp.py checkpoint_dir=... push_to_hub=${HF_USER}/my_policy private=true license=mit tags=[so101]

The same command is installed as `lerobot-mg-convert-dcp`; see lerobot_mg/checkpoint/convert.py.
"""

from lerobot_mg.scripts_entry import convert_dcp

if __name__ == "__main__":
    convert_dcp()
