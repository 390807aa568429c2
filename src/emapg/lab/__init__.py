"""The study lab, apart from the RL library (which never imports it): `emapg compare` runs
configurations x seeds as separate `emapg train` processes (`study`), reports them (`report`), and
judges a study's pre-registered hypotheses (`verdicts`, with the tests of `emapg.stats`)."""
