"""`parallel:` model-parallel layout of the trainer."""

from pydantic import Field

from mtprun.spec.base import Section


class ParallelSection(Section):
    """Model-parallel layout of the trainer: tp*pp*cp*dp processes."""

    tp: int = Field(1, ge=1, description="Tensor parallel size (splits heads and the vocab).")
    pp: int = Field(1, ge=1, description="Pipeline parallel size.")
    cp: int = Field(1, ge=1, description="Context parallel size (splits each sequence).")
    dp: int = Field(1, ge=1, description="Data parallel size.")
    ep: int = Field(
        1,
        ge=1,
        description="Expert parallel size (mixture-of-experts models): each group of ep "
        "data-parallel ranks splits every layer's experts among them. It divides dp and the "
        "experts, and adds no processes.",
    )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp
