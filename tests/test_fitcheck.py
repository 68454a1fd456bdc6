"""kernel_magics.fitcheck on cell text: a fit given no data is refused before anything starts; what the
text cannot show for certain (data passed through **kwargs, a receiver the cell rebinds or compiles) is
left to the run."""

from __future__ import annotations

import pytest

from tfdist.errors import TfdistError
from tfdist.kernel_magics.fitcheck import check_compiled, check_fits


@pytest.mark.parametrize(
    "source",
    ["model.fit(epochs=3)", "h = model.fit()", "for i in range(2):\n    m.fit(epochs=1, steps_per_epoch=3)"],
)
def test_a_fit_given_no_data_is_refused_with_the_fix(source):
    with pytest.raises(TfdistError) as e:
        check_fits(source, {}, [])
    msg = str(e.value)
    assert msg.startswith("the cell's fit is given no data") and msg.endswith("nothing was started")
    assert ".fit(train_ds, epochs=5)" in msg


@pytest.mark.parametrize(
    "source",
    ["model.fit(ds)", "model.fit(x=ds, epochs=2)", "model.fit(**kw)", "model.fit(*args)", "not python (", ""],
)
def test_data_given_or_not_readable_here_is_left_to_the_run(source):
    check_fits(source, {}, [])


def test_a_non_model_name_is_not_judged_and_a_rebound_or_compiled_receiver_is_skipped():
    # no TensorFlow here: an object that is no Keras model is never called uncompiled
    check_compiled("model", {"model": object()})
    check_compiled("model", {}, None)  # not a notebook name: the run says what is wrong
    check_fits("model = build()\nmodel.fit(ds)", {"model": object()}, ["model"])
